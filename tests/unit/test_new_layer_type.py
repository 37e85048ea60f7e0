"""A new layer type defined entirely here and added with one ``register_layer_type`` call.

The type is a toy token mixer, ``C``: a causal running mean of the normalised tokens, projected
and added to the residual. With nothing but its two records registered, its symbol parses,
``describe`` names it, it builds alone and in groups, its parameters take the checkpoint keys
the key rules (``megatron_hybrid.checkpointing.keys``) give, a ``torch_dist`` checkpoint saves and
loads, and it runs in the EP-overlap schedule plan with the numerics of the plain schedule (two
gloo ranks, EP 2). A fixture registers it and takes it away again, so every other test sees the
built-in alphabet.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_hybrid.checkpointing.keys import decoder_layer_key
from megatron_hybrid.modules import (
    LayerRuntime,
    ScheduleRole,
    register_layer_type,
    unregister_layer_type,
)
from megatron_hybrid.pattern import (
    HybridPatternError,
    LayerTypeFacts,
    Slot,
    accepts_thd,
    layer_symbols,
    parse_pattern,
)

SYMBOL = "C"


class CumulativeMixer(MegatronModule):
    """``h + proj(running_mean(norm(h)))`` over the sequence axis of ``[s, b, h]``."""

    def __init__(self, config, layer_number: int, **unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.mixer_norm = torch.nn.LayerNorm(config.hidden_size, dtype=config.params_dtype)
        self.mixer_proj = torch.nn.Linear(
            config.hidden_size, config.hidden_size, bias=False, dtype=config.params_dtype
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.mixer_norm(hidden_states)
        steps = torch.arange(1, normed.shape[0] + 1, dtype=normed.dtype, device=normed.device)
        mixed = normed.cumsum(0) / steps.view(-1, 1, 1)
        return hidden_states + self.mixer_proj(mixed)


def _build(spec, args):
    return build_module(spec, config=args.config, layer_number=args.layer_number)


FACTS = LayerTypeFacts(
    symbol=SYMBOL,
    name="cumulative mixer",
    slot=Slot.MIXER,
    thd_rule=accepts_thd,
    colour="#117733",
)
RUNTIME = LayerRuntime(
    symbol=SYMBOL,
    spec_field="cumulative_mixer_layer",
    build=_build,
    forward=lambda layer, hidden_states, inputs: layer(hidden_states),
    schedule_role=ScheduleRole.PRE_LAYER,
    run_pre_dispatch=lambda layer, hidden_states, node: layer(hidden_states),
    default_spec=lambda backend: ModuleSpec(module=CumulativeMixer),
)
# Negative control for the schedule: a pre-dispatch runner that skips the mixer.
SKIPPING_RUNTIME = dataclasses.replace(
    RUNTIME, run_pre_dispatch=lambda layer, hidden_states, node: hidden_states
)


@pytest.fixture
def toy_type():
    """The toy type, registered for one test and removed after it."""
    register_layer_type(FACTS, RUNTIME)
    yield FACTS
    unregister_layer_type(SYMBOL)


# --- pure facts: parsing, describe, THD -------------------------------------------------------


def test_registration_extends_the_alphabet_and_is_undone():
    with pytest.raises(HybridPatternError, match="invalid character 'C'"):
        parse_pattern("[CE]{2}")
    register_layer_type(FACTS, RUNTIME)
    try:
        assert SYMBOL in layer_symbols()
        parsed = parse_pattern("[CE]{2}")
        assert parsed.canonical == "[CE][CE]"
        assert parsed.layer_counts[SYMBOL] == 2
        with pytest.raises(HybridPatternError, match="second mixer-slot layer"):
            parse_pattern("[CME]")  # C takes the mixer slot, like M
    finally:
        unregister_layer_type(SYMBOL)
    # The parse cache must not keep the registered alphabet alive.
    with pytest.raises(HybridPatternError, match="invalid character 'C'"):
        parse_pattern("[CE]{2}")
    assert SYMBOL not in layer_symbols()


def test_describe_names_the_type(toy_type, capsys):
    from megatron_hybrid.cli.main import main

    assert main(["describe", "[CE]{2}"]) == 0
    out = capsys.readouterr().out
    assert "E MoE: 2, C cumulative mixer: 2" in out  # built-ins first, then registration order
    assert "cumulative mixer + MoE" in out
    assert "decoder.layers.1." in out  # no GPT role: the indexed logical form


def test_describe_draws_the_type_in_its_colour(toy_type, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PatchCollection

    from megatron_hybrid.cli.main import main

    colours = []
    original = PatchCollection.__init__

    def record(self, patches, *args, facecolors=None, **kwargs):
        colours.append(facecolors)
        original(self, patches, *args, facecolors=facecolors, **kwargs)

    monkeypatch.setattr(PatchCollection, "__init__", record)
    assert main(["describe", "[CE]", "--png", str(tmp_path / "stack.png")]) == 0
    assert (tmp_path / "stack.png").stat().st_size > 0
    assert colours[0] == [FACTS.colour, "#F0E442"]  # the layers: C, then E in MoE's colour


def test_thd_rule_comes_from_the_facts(toy_type):
    from megatron_hybrid.padding.layout_support import thd_unsupported_reason

    assert thd_unsupported_reason("[CE]", transformer_impl="local") is None
    from megatron_hybrid.pattern.thd_rules import unchecked_thd

    unchecked = dataclasses.replace(FACTS, symbol="Q", thd_rule=unchecked_thd)
    register_layer_type(unchecked, dataclasses.replace(RUNTIME, symbol="Q", spec_field="q_layer"))
    try:
        assert "was not checked for packed (THD) input" in thd_unsupported_reason("Q")
    finally:
        unregister_layer_type("Q")


@pytest.mark.parametrize(
    ("facts", "runtime", "match"),
    [
        pytest.param(FACTS, RUNTIME, None, id="taken-twice"),
        pytest.param(
            dataclasses.replace(FACTS, symbol="["),
            dataclasses.replace(RUNTIME, symbol="["),
            "cannot be a layer symbol",
            id="structure-character",
        ),
        pytest.param(
            dataclasses.replace(FACTS, symbol="c"),
            dataclasses.replace(RUNTIME, symbol="c"),
            "cannot be a layer symbol",
            id="lower-case",
        ),
        pytest.param(
            dataclasses.replace(FACTS, symbol="Q", slot=Slot.MLP),
            dataclasses.replace(RUNTIME, symbol="Q"),
            "schedule_role must be DENSE_MLP or MOE",
            id="mlp-slot-as-pre-layer",
        ),
        pytest.param(
            dataclasses.replace(FACTS, symbol="Q"),
            dataclasses.replace(RUNTIME, symbol="Q", default_spec=None),
            "needs runtime.default_spec",
            id="no-spec",
        ),
        pytest.param(
            dataclasses.replace(FACTS, symbol="Q", colour="green"),
            dataclasses.replace(RUNTIME, symbol="Q"),
            "colour of 'Q' must look like",
            id="bad-colour",
        ),
    ],
)
def test_registration_refuses_bad_records(toy_type, facts, runtime, match):
    with pytest.raises(ValueError, match=match or "already taken by cumulative mixer"):
        register_layer_type(facts, runtime)
    assert "Q" not in layer_symbols() and "[" not in layer_symbols()


def test_built_in_types_cannot_be_unregistered():
    with pytest.raises(ValueError, match="built-in layer type 'E' cannot be unregistered"):
        unregister_layer_type("E")


# --- runtime: build, keys, checkpoints ----------------------------------------------------------


def _model(pg, pattern: str, seed: int):
    from megatron_hybrid.testing.models import build_hybrid, small_config

    torch.manual_seed(seed)
    return build_hybrid(small_config(pattern), pattern, pg)


@pytest.mark.parametrize(
    ("pattern", "final_norm"),
    [
        pytest.param("[CE]{2}", "decoder.final_layernorm.", id="in-groups"),
        pytest.param("[C*E]", "decoder.final_layernorm.", id="group-of-three"),
        pytest.param("C[*E]", "decoder.final_layernorm.", id="alone-in-grouped-pattern"),
        pytest.param("C*E", "decoder.final_norm.", id="alone-without-groups"),
    ],
)
def test_builds_and_takes_the_keys_of_the_key_rules(toy_type, pg, pattern, final_norm):
    from megatron_hybrid.testing.models import model_inputs

    model = _model(pg, pattern, seed=1)
    parsed = parse_pattern(pattern)
    mixers = [
        (symbol, layer)
        for symbol, layer in model.decoder.iter_physical_layers()
        if isinstance(layer, CumulativeMixer)
    ]
    assert [symbol for symbol, _ in mixers] == [SYMBOL] * parsed.layer_counts[SYMBOL]
    assert torch.isfinite(model(**model_inputs())).all()

    keys = {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}
    for layer in parsed.logical_layers:
        if SYMBOL not in layer.members:
            continue
        prefix = str(decoder_layer_key(parsed, layer.index))
        assert {f"{prefix}mixer_norm.weight", f"{prefix}mixer_proj.weight"} <= keys
    assert f"{final_norm}weight" in keys


def test_checkpoint_saves_and_loads(toy_type, pg, tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_hybrid.testing.models import model_inputs

    source, target = _model(pg, "[CE]{2}", seed=1), _model(pg, "[CE]{2}", seed=2)
    inputs = model_inputs()
    # Different seeds give different weights, so equal results below come from the load.
    assert not torch.equal(source(**inputs), target(**inputs))
    dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path))
    state = dist_checkpointing.load(target.sharded_state_dict(), str(tmp_path))
    missing, unexpected = target.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    for name, tensor in source.state_dict().items():
        if torch.is_tensor(tensor):
            assert torch.equal(target.state_dict()[name], tensor), name
    assert torch.equal(source(**inputs), target(**inputs))


def test_a_backend_can_build_the_type_itself(toy_type, monkeypatch):
    from megatron_hybrid.modules import specs

    monkeypatch.setattr(specs, "BACKENDS", dict(specs.BACKENDS))
    own = ModuleSpec(module=CumulativeMixer, params={"marker": "backend"})
    specs.register_backend(
        "local-with-mixer", lambda opts: {**specs._local_layers(opts), RUNTIME.spec_field: own}
    )
    with pytest.raises(ValueError, match="already registered"):
        specs.register_backend("local", specs._local_layers)
    built = specs.hybrid_stack_spec("local-with-mixer").submodules.extra_layers
    default = specs.hybrid_stack_spec("local").submodules.extra_layers
    assert built[RUNTIME.spec_field] is own
    assert default[RUNTIME.spec_field].params == {}


def test_deprecated_registry_names_still_resolve(toy_type):
    import megatron_hybrid.modules as modules
    from megatron_hybrid.modules.registry import LAYER_RUNTIMES
    from megatron_hybrid.schedule import PRE_LAYER_RUNNERS, register_pre_layer_runner

    with pytest.warns(DeprecationWarning, match="use LayerRuntime"):
        assert modules.LayerKind is LayerRuntime
    with pytest.warns(DeprecationWarning, match="use LAYER_RUNTIMES"):
        assert modules.LAYER_KINDS is LAYER_RUNTIMES
    assert PRE_LAYER_RUNNERS[SYMBOL] is RUNTIME.run_pre_dispatch
    assert "E" not in PRE_LAYER_RUNNERS  # terminals have no pre-dispatch runner

    def runner(layer, hidden_states, node):
        return hidden_states

    with pytest.warns(DeprecationWarning, match="register_pre_layer_runner is deprecated"):
        register_pre_layer_runner(SYMBOL, runner)
    assert PRE_LAYER_RUNNERS[SYMBOL] is runner


def test_a_type_without_pre_dispatch_runner_is_refused_by_the_plan(pg):
    from megatron_hybrid.schedule import UnschedulableLayerError, build_layer_callables
    from megatron_hybrid.schedule.plan import logical_layer_members

    register_layer_type(FACTS, dataclasses.replace(RUNTIME, run_pre_dispatch=None))
    try:
        model = _model(pg, "[CE]", seed=1)
        members = logical_layer_members(model.decoder.layers[0], model.decoder.layer_type_list[0])
        with pytest.raises(
            UnschedulableLayerError, match=r"cumulative mixer \('C'\) layers cannot"
        ):
            build_layer_callables(members)
    finally:
        unregister_layer_type(SYMBOL)


# --- the EP-overlap schedule plan on two gloo ranks ---------------------------------------------


def overlap_worker(rank, world_size, pattern):
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid, small_config
    from megatron_hybrid.testing.overlap import compare_overlap

    pg = initialize_model_parallel(ep=2, seed=5)

    def build(run_config):
        torch.manual_seed(3)
        return [Float16Module(run_config, build_hybrid(run_config, pattern, pg))]

    results = {}
    for name, runtime in (("registered", RUNTIME), ("skipping_runner", SKIPPING_RUNTIME)):
        register_layer_type(FACTS, runtime)  # a spawned rank starts with the built-ins only
        try:
            config = small_config(
                pattern,
                expert_model_parallel_size=2,
                bf16=True,
                params_dtype=torch.bfloat16,
                pipeline_dtype=torch.bfloat16,
            )
            out = compare_overlap(build, config, steps=1, num_microbatches=2)
        finally:
            unregister_layer_type(SYMBOL)
        plain, overlap = out["plain"], out["overlap"]
        results[name] = {
            "plain": plain["losses"],
            "overlap": overlap["losses"],
            "grads_equal": all(
                torch.equal(overlap["grads"][0][key], grad)
                for key, grad in plain["grads"][0].items()
            ),
        }
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_runs_in_the_ep_overlap_schedule():
    from megatron_hybrid.testing.spawn import run_distributed

    ranks = run_distributed(overlap_worker, 2, "[CE]{2}", timeout=600)
    for results in ranks:
        registered, skipping = results["registered"], results["skipping_runner"]
        assert registered["plain"], "no losses reported"
        assert registered["overlap"] == registered["plain"]
        assert registered["grads_equal"]
        # Negative control: the overlapped plan really runs the type's pre-dispatch runner.
        assert skipping["overlap"] != skipping["plain"]

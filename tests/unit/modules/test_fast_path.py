"""The fast TE-free path as a whole: where it is chosen, and whole models equal to the reference.

``hybrid_stack_spec("local")`` builds the fast classes where CUDA is available and the reference
classes elsewhere; ``local_impl`` forces either. On the CPU (float32) a model of each symbol mix
the performance page measures (``[*E]``, ``[GE]``, ``[ME]``, ``[+E]``) built on the fast path
has the reference model's parameters, state dict and sharded keys, runs every fast module fast,
and gives its loss and every gradient to float32 rounding: within :data:`TOL`, or the margin
times the rounding scale of that gradient where larger (``rounding.float32_error_scale`` of the
reference model: GatedDeltaNet's ``dt_bias`` and ``A_log`` gradients sum per-token terms that
cancel, so their float32 error is some 100 times that of the other gradients, and how large it
comes out depends on the machine). Negative controls: the reference spec contains no fast class;
an unknown ``local_impl`` is refused; a fast model whose gate bias moved by 1e-3 fails the
bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import pytest
import torch
from rounding import float32_bounds
from support.mla import mla_config

from megatron_hybrid.testing.overlap import rel_error

#: Relative error allowed in a loss or gradient: over 10x the float32 rounding scale of every
#: well-conditioned gradient of these models (at most 7e-7).
TOL = 1e-5


def _classes(obj, found=None) -> set[type]:
    """Every class referenced anywhere in a spec tree."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    found = set() if found is None else found
    if isinstance(obj, type):
        found.add(obj)
    elif isinstance(obj, ModuleSpec):
        for part in (obj.module, obj.submodules, obj.params):
            _classes(part, found)
    elif isinstance(obj, functools.partial):
        _classes(obj.func, found)
        for value in (*obj.args, *obj.keywords.values()):
            _classes(value, found)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _classes(getattr(obj, f.name), found)
    elif isinstance(obj, dict):
        for value in obj.values():
            _classes(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _classes(value, found)
    return found


def test_local_impl_resolution(monkeypatch, megatron_cpu):
    from megatron_hybrid.modules.fast.selection import resolve_local_impl

    assert resolve_local_impl("auto") == "reference"  # the CPU runtime hides CUDA
    assert resolve_local_impl("fast") == "fast"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_local_impl("auto") == "fast"
    assert resolve_local_impl("reference") == "reference"
    with pytest.raises(ValueError, match="local_impl must be one of"):
        resolve_local_impl("turbo")


def test_spec_swaps_every_reference_class(megatron_cpu):
    from megatron_hybrid.modules import hybrid_stack_spec
    from megatron_hybrid.modules.fast.specs import FAST_CLASSES

    fast = _classes(hybrid_stack_spec("local", local_impl="fast").submodules)
    reference = _classes(hybrid_stack_spec("local", local_impl="reference").submodules)
    assert set(FAST_CLASSES.values()) <= fast
    assert not set(FAST_CLASSES) & fast
    assert not set(FAST_CLASSES.values()) & reference  # negative control
    assert hybrid_stack_spec("local", local_impl="fast").metainfo["local_impl"] == "fast"
    with pytest.raises(ValueError, match="local_impl must be one of"):
        hybrid_stack_spec("local", local_impl="turbo")


def _config(pattern: str):
    from megatron_hybrid.testing.models import small_config

    config = small_config(pattern, gated_linear_unit=True,
                          activation_func=torch.nn.functional.silu)  # fmt: skip
    return mla_config(config) if "+" in pattern else config


def _model(model_parallel, pattern, local_impl):
    from megatron_hybrid.model import HybridModel
    from megatron_hybrid.modules import hybrid_stack_spec

    pg = model_parallel(seed=3)
    config = _config(pattern)
    torch.manual_seed(1)
    return HybridModel(config, hybrid_stack_spec("local", config=config, local_impl=local_impl),
                       vocab_size=128, max_sequence_length=64, hybrid_layer_pattern=pattern,
                       pg_collection=pg, position_embedding_type="rope")  # fmt: skip


def _step(model, rounding=None):
    """``{"loss": loss, name: gradient}`` of one forward and backward pass."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 40), generator=gen)
    with rounding or contextlib.nullcontext():
        loss = model(input_ids=tokens, position_ids=torch.arange(40).expand(2, -1),
                     attention_mask=None, labels=tokens).float().mean()  # fmt: skip
        loss.backward()
    results = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), **results}


def _bounds(model_parallel, pattern) -> dict[str, float]:
    """The relative error each result of the reference model may carry on any machine."""

    def evaluate(rounding):
        return _step(_model(model_parallel, pattern, "reference"), rounding)

    return float32_bounds(evaluate, measure=rel_error, floor=TOL)


def _over_bound(results, reference, bounds) -> list[tuple[str, float, float]]:
    """``(name, relative error, bound)`` of every nonzero result outside its bound."""
    return [
        (name, rel_error(results[name], value), bounds[name])
        for name, value in reference.items()
        if value.abs().sum() > 0 and rel_error(results[name], value) > bounds[name]
    ]


@pytest.mark.parametrize("pattern", ["[*E]{2}", "[GE]{2}", "[ME]{2}", "[+E]{2}"])
def test_fast_model_equals_reference_model(model_parallel, pattern):
    from megatron_hybrid.modules.fast import fast_path_report

    bounds = _bounds(model_parallel, pattern)
    reference = _model(model_parallel, pattern, "reference")
    expected = _step(reference)
    ref_keys = sorted(reference.sharded_state_dict())
    ref_state = reference.state_dict()
    fast = _model(model_parallel, pattern, "fast")
    assert list(fast.state_dict()) == list(ref_state)
    assert sorted(fast.sharded_state_dict()) == ref_keys
    results = _step(fast)
    report = fast_path_report(fast)
    assert report and set(report.values()) == {"fast"}, report
    assert set(results) == set(expected)
    assert _over_bound(results, expected, bounds) == []
    if pattern == "[GE]{2}":  # negative control: the widened bounds still see a small defect
        broken = _model(model_parallel, pattern, "fast")
        with torch.no_grad():
            for name, parameter in broken.named_parameters():
                if name.endswith("dt_bias"):
                    parameter.add_(1e-3)
        assert _over_bound(_step(broken), expected, bounds)


def test_compiled_piece_records_and_falls_back(monkeypatch, megatron_cpu):
    import torch._dynamo

    from megatron_hybrid.modules.fast import compiled

    def piece(x, scale):
        return (x * scale).exp().sum(-1)

    x = torch.randn(3, 4)
    eager = compiled.CompiledPiece(piece, "test_piece_eager")
    assert torch.equal(eager(x, 2.0), piece(x, 2.0))  # dynamo disabled by the CPU runtime
    assert "test_piece_eager" not in compiled.COMPILE_SECONDS

    # The config's own patch context: it restores the setting (monkeypatch would delete it).
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # set by the CPU runtime too
    with torch._dynamo.config.patch(disable=False):
        traced = compiled.CompiledPiece(piece, "test_piece", backend="eager")
        torch.testing.assert_close(traced(x, 2.0), piece(x, 2.0))
        traced(x, 2.0)  # same signature: no second compile recorded
        first = compiled.COMPILE_SECONDS["test_piece"]
        traced(torch.randn(5, 4), 2.0)
        assert compiled.COMPILE_SECONDS["test_piece"] > first and traced.failure is None
        assert traced.compiles == 2

    def broken(*args, **kwargs):
        def fail(*a, **k):
            raise RuntimeError("inductor cannot do this\nsecond line")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    failing = compiled.CompiledPiece(piece, "test_piece_broken")
    with torch._dynamo.config.patch(disable=False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = failing(x, 2.0)
    assert torch.equal(out, piece(x, 2.0))
    assert failing.failure == "RuntimeError: inductor cannot do this"
    assert any("running it eagerly" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("dynamic", "compiles"),
    [
        pytest.param(None, 2, id="automatic-dynamic"),
        pytest.param(False, 6, id="control-one-graph-per-length"),
    ],
)
def test_compiled_piece_compiles_twice_for_any_number_of_lengths(
    monkeypatch, megatron_cpu, dynamic, compiles
):
    """Variable-length micro-batches (six sequence lengths, as a padded batch of train's data
    gives them) compile one graph for the first length and one symbolic graph for the rest; the
    control specialises a graph to each length."""
    import torch._dynamo

    from megatron_hybrid.modules.fast import compiled

    def piece(x, weight, chunk: int):
        pad = (-x.shape[0]) % chunk  # as the Mamba scan pads to whole chunks
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return (x @ weight).exp().cumsum(0)[: x.shape[0] - pad]

    weight = torch.randn(4, 4)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        traced = compiled.CompiledPiece(piece, f"lengths_{dynamic}", "eager", dynamic=dynamic)
        for length in (64, 80, 96, 128, 160, 256):
            x = torch.randn(length, 4)
            torch.testing.assert_close(traced(x, weight, 32), piece(x, weight, 32))
    assert traced.compiles == compiles and traced.failure is None

"""apply_lora: coverage of every layer type, targets, the zero start, disable_lora, refusals,
the shared-A and per-expert variants."""

from __future__ import annotations

import json
import shutil

import peft_oracle
import pytest
import torch
from test_peft_oracle import REL_L2, errors, logits_of

from megatron_hybrid.hf import iter_hf_weights, load_hf_model
from megatron_hybrid.peft import (
    LoRAConfig,
    LoRAConfigError,
    apply_lora,
    disable_lora,
    iter_lora_weights,
    load_peft_adapter,
    lora_parameters,
    save_peft_adapter,
)
from megatron_hybrid.peft.linears import linear_info

FAMILIES = pytest.mark.parametrize("family", peft_oracle.FAMILIES)

#: Linears that are never targets.
NOT_TARGETS = ("output_layer", "eh_proj")


def _linears(model):
    return {
        name: module
        for name, module in model.named_modules()
        if linear_info(module) is not None and name.rsplit(".", 1)[-1] not in NOT_TARGETS
    }


def _randomise(model, seed=1, std=0.05):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora_parameters(model):
            param.copy_(std * torch.randn(param.shape, generator=generator))


@FAMILIES
def test_all_linear_covers_every_linear_and_only_lora_trains(family, cases, input_ids, pg):
    model = load_hf_model(cases[family].hf)
    base = logits_of(model, input_ids)
    apply_lora(model, LoRAConfig(rank=4, alpha=8))
    linears = _linears(model)
    assert linears and all(hasattr(m, "lora") for m in linears.values()), [
        n for n, m in linears.items() if not hasattr(m, "lora")
    ]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in lora_parameters(model)}
    # Routers and the shared-expert gate are not adapted.
    assert not any(hasattr(m, "lora") for n, m in model.named_modules() if n.endswith("router"))
    zero = logits_of(model, input_ids)
    with disable_lora(model):
        frozen = logits_of(model, input_ids)
    assert torch.equal(zero, frozen)  # B = 0: the base, bitwise
    # megatron-core multiplies frozen weights in another function (tensor_parallel/layers.py:
    # linear_with_frozen_weight), which rounds Mamba's out_proj differently.
    assert (frozen - base).abs().max().item() <= 1e-5
    _randomise(model)
    adapted = logits_of(model, input_ids)
    assert (adapted - base).abs().max().item() > 0.1
    with disable_lora(model):
        assert torch.equal(logits_of(model, input_ids), frozen)
    assert torch.equal(logits_of(model, input_ids), adapted)  # restored on exit


def test_layer_types_and_pieces(cases, pg):
    model = apply_lora(load_hf_model(cases["qwen3_5_moe"].hf), LoRAConfig(rank=2, alpha=2))
    by_path = {c.path: c for c in model.lora_state.adapted}
    gdn = by_path["decoder.layers.0.layers.0.self_attention.in_proj"]
    assert gdn.symbol == "G" and [p.rsplit(".", 1)[1] for p in gdn.pieces] == [
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
    ]
    qkv = by_path["decoder.layers.3.layers.0.self_attention.linear_qkv"]
    assert qkv.symbol == "*" and [p.rsplit(".", 1)[1] for p in qkv.pieces] == [
        "q_proj",
        "k_proj",
        "v_proj",
    ]
    expert = by_path["decoder.layers.0.layers.1.mlp.experts.local_experts.3.linear_fc1"]
    assert expert.symbol == "E" and expert.pieces == ("model.layers.0.mlp.experts.gate_up_proj",)
    assert expert.module.lora.a().shape == (2, 64)  # one A for gate and up, as PEFT's 3-D layout
    shared = by_path["decoder.layers.0.layers.1.mlp.shared_experts.linear_fc1"]
    assert shared.module.lora.a().shape == (4, 64)  # gate and up: one A each


def test_hugging_face_names_select_pieces(cases, input_ids, pg, tmp_path):
    case = cases["qwen3_5"]
    model = load_hf_model(case.hf)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=["q_proj", "v_proj"]))
    qkv = next(c for c in model.lora_state.adapted if c.name == "linear_qkv")
    assert [qkv.pieces[i].rsplit(".", 1)[1] for i in sorted(qkv.active)] == ["q_proj", "v_proj"]
    assert len(model.lora_state.adapted) == 1  # one attention layer
    _randomise(model)
    save_peft_adapter(model, tmp_path / "qv")
    config = json.loads((tmp_path / "qv" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]
    theirs, live = peft_oracle.peft_logits(case.hf, tmp_path / "qv", input_ids)
    assert live == 4
    max_abs, rel = errors(logits_of(model, input_ids), theirs)
    assert max_abs <= peft_oracle.peft_bound(case.hf, tmp_path / "qv", input_ids)
    assert rel <= REL_L2


def test_partial_layers_are_named_in_full(cases, input_ids, pg, tmp_path):
    case = cases["qwen3_5_moe"]
    model = load_hf_model(case.hf)
    config = LoRAConfig(rank=4, alpha=8, exclude=["decoder.layers.1.*", "decoder.layers.2.*"])
    apply_lora(model, config)
    _randomise(model)
    save_peft_adapter(model, tmp_path / "part")
    saved = json.loads((tmp_path / "part" / "adapter_config.json").read_text())
    assert "model.layers.0.linear_attn.in_proj_qkv" in saved["target_modules"]
    assert "q_proj" in saved["target_modules"]  # the one attention layer is adapted
    theirs, live = peft_oracle.peft_logits(case.hf, tmp_path / "part", input_ids)
    assert live == len(list(iter_lora_weights(model)))
    max_abs, rel = errors(logits_of(model, input_ids), theirs)
    assert max_abs <= peft_oracle.peft_bound(case.hf, tmp_path / "part", input_ids)
    assert rel <= REL_L2


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_shared_a_exports_exactly(family, cases, input_ids, pg, tmp_path):
    case = cases[family]
    model = apply_lora(load_hf_model(case.hf), LoRAConfig(rank=4, alpha=8, shared_a=True))
    gdn = next(c for c in model.lora_state.adapted if c.name == "in_proj")
    assert gdn.module.lora.a().shape[0] == 4  # one A for all pieces
    _randomise(model)
    save_peft_adapter(model, tmp_path / "shared")
    theirs, _ = peft_oracle.peft_logits(case.hf, tmp_path / "shared", input_ids)
    max_abs, rel = errors(logits_of(model, input_ids), theirs)
    assert max_abs <= peft_oracle.peft_bound(case.hf, tmp_path / "shared", input_ids)
    assert rel <= REL_L2


def test_per_expert_format_is_the_peft_layout_expert_by_expert(cases, pg):
    """per_expert names each expert's pieces; the tensors are those of peft's 3-D layout (its
    folders are written for engines: peft 0.21 drops these names, so they are not loaded back,
    test_peft_config.py)."""
    from megatron_hybrid.peft.formats import unpack_experts

    case = cases["qwen3_5_moe"]
    model = load_peft_adapter(load_hf_model(case.hf), case.adapter)
    per = dict(iter_lora_weights(model, format="per_expert"))
    assert not any(".experts.lora_" in n or "base_layer" in n for n in per)
    packed = dict(iter_lora_weights(model))
    prefix = "base_model.model.model.layers.0.mlp.experts."
    a, b = packed[prefix + "base_layer.lora_A.weight"], packed[prefix + "base_layer.lora_B.weight"]
    rank = peft_oracle.RANK
    a_list, b_list = unpack_experts(a, b, a.shape[0] // rank, rank)
    for e in (0, 3):
        gate, up = f"{prefix}{e}.gate_proj.lora_", f"{prefix}{e}.up_proj.lora_"
        assert torch.equal(per[gate + "A.weight"], a_list[e])
        assert torch.equal(per[up + "A.weight"], a_list[e])  # one A for gate and up
        assert torch.equal(torch.cat([per[gate + "B.weight"], per[up + "B.weight"]]), b_list[e])


def test_nemotron_mamba_out_proj_is_refused_by_name(cases, pg, tmp_path):
    model = apply_lora(load_hf_model(cases["nemotron_h"].hf), LoRAConfig(rank=4, alpha=8))
    with pytest.raises(LoRAConfigError, match="out_proj.*merge_lora=True"):
        save_peft_adapter(model, tmp_path / "x")
    with pytest.raises(LoRAConfigError, match="out_proj"):
        next(iter_lora_weights(model))


@pytest.mark.parametrize(
    "targets, message",
    [
        (["lienar_qkv"], "match nothing"),
        (["q_a_proj"], "match nothing"),  # a DeepSeek-V3 name
        (["decoder.layers.9.*"], "match nothing"),
    ],
)
def test_unmatched_targets_are_errors(targets, message, cases, pg):
    model = load_hf_model(cases["qwen3_5_moe"].hf)
    with pytest.raises(LoRAConfigError, match=message):
        apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=targets))
    assert not any(p.requires_grad is False for p in model.parameters())  # nothing changed


def test_applying_twice_is_refused(cases, pg):
    model = apply_lora(load_hf_model(cases["qwen3_5"].hf), LoRAConfig(rank=4, alpha=8))
    with pytest.raises(LoRAConfigError, match="already has LoRA"):
        apply_lora(model, LoRAConfig(rank=4, alpha=8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0, alpha=8), "rank"),
        (dict(rank=4, alpha=0), "alpha"),
        (dict(rank=4, alpha=8, dropout=1.0), "dropout"),
        (dict(rank=4, alpha=8, targets=[]), "empty"),
        (dict(rank=4, alpha=8, targets=["all-linear", "q_proj"]), "already covers"),
        (dict(rank=4, alpha=8, targets=["q proj"]), "not a target name"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(LoRAConfigError, match=message):
        LoRAConfig(**kwargs)


def test_config_round_trips_through_a_dict():
    config = LoRAConfig(rank=8, alpha=16, targets=["linear_qkv"], exclude=["mtp.*"])
    assert LoRAConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.scale == 2.0 and LoRAConfig(rank=4, alpha=8, use_rslora=True).scale == 4.0


def test_mtp_layers_take_adapters_only_when_named(cases, pg, tmp_path):
    """all-linear (and names) leave MTP out, as peft's all-linear on the transformers model,
    which has no MTP modules, would: the adapter exports as a PEFT folder. Targets that name
    mtp.* adapt MTP layers; those export merged only."""
    import hf_oracle

    folder = tmp_path / "mtp"
    shutil.copytree(cases["qwen3_5_moe"].hf, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    hf_oracle.add_fake_mtp_tensors(folder, "qwen3_5_moe")
    for targets in ("all-linear", ["q_proj", "linear_fc1"]):
        model = apply_lora(load_hf_model(folder), LoRAConfig(rank=4, alpha=8, targets=targets))
        assert model.lora_state.adapted
        assert not any(c.path.startswith("mtp.") for c in model.lora_state.adapted), targets
    save_peft_adapter(model, tmp_path / "no_mtp")
    model = apply_lora(load_hf_model(folder), LoRAConfig(rank=4, alpha=8, targets=["mtp.*"]))
    mtp = [c for c in model.lora_state.adapted if c.path.startswith("mtp.")]
    assert {c.name for c in mtp} == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert len(mtp) == len(model.lora_state.adapted)
    _randomise(model)
    with pytest.raises(LoRAConfigError, match="MTP layer.*merge_lora=True"):
        save_peft_adapter(model, tmp_path / "x")
    base = dict(iter_hf_weights(load_hf_model(folder)))
    merged = dict(iter_hf_weights(model, merge_lora=True))
    assert not torch.equal(
        merged["mtp.layers.0.self_attn.q_proj.weight"], base["mtp.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(merged["mtp.fc.weight"], base["mtp.fc.weight"])  # eh_proj: no adapter


@pytest.mark.parametrize("recompute", [None, "full"], ids=["plain", "full_recompute"])
def test_adapters_get_gradients_with_recompute(recompute, pg):
    """A frozen embedding's output would carry no gradient into reentrant recompute (whose
    recomputed layers then never reach the adapters); apply_lora makes it require grad."""
    from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config

    overrides = (
        {}
        if recompute is None
        else dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    )
    torch.manual_seed(0)
    model = build_hybrid(small_config("[*E]{2}", **overrides), "[*E]{2}", pg)
    apply_lora(model, LoRAConfig(rank=2, alpha=4))
    _randomise(model)
    batch = model_inputs()
    loss = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"]).sum()
    loss.backward()
    grads = [p.grad for p in lora_parameters(model)]
    assert all(g is not None for g in grads) and all(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize(
    "targets",
    [("all-linear",), ("*.local_experts.0.linear_fc1", "*.local_experts.1.linear_fc2")],
    ids=["every_expert", "some_experts"],
)
def test_grouped_gemm_experts_run_their_adapters(pg, monkeypatch, targets):
    """The fast path's grouped-GEMM experts never call their expert linears: the adapters join
    its grouped_linear seam and give the per-expert loop's logits and gradients, also where
    only some local experts have an adapter (the others' rows get none)."""
    from megatron_hybrid.modules.fast import experts as fast_experts
    from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config

    config = small_config("[*E]{2}", moe_ffn_hidden_size=32)
    batch = model_inputs()
    runs = {}
    for path in ("grouped", "loop", "grouped_without_adapters"):
        torch.manual_seed(0)
        model = build_hybrid(config, "[*E]{2}", pg, local_impl="fast")
        apply_lora(model, LoRAConfig(rank=2, alpha=4, targets=targets))
        _randomise(model, std=0.5)
        grouped = [m for m in model.modules() if isinstance(m, fast_experts.GroupedGemmExperts)]
        assert grouped
        with monkeypatch.context() as patch:
            if path == "loop":  # the reference loop: each expert linear with its hook
                patch.setattr(fast_experts, "grouped_gemm_reason", lambda *args: "forced")
            elif path == "grouped_without_adapters":  # the seam unhooked: a silent drop
                for module in grouped:
                    del module.grouped_linear
            loss = model(batch["input_ids"], batch["position_ids"], None,
                         labels=batch["labels"]).sum()  # fmt: skip
            loss.backward()
        reasons = {m.fast_path_reason for m in grouped}
        assert reasons == ({"forced"} if path == "loop" else {None}), reasons
        grads = [None if p.grad is None else p.grad.clone() for p in lora_parameters(model)]
        runs[path] = loss.item(), grads
    (grouped_loss, grouped_grads), (loop_loss, loop_grads) = runs["grouped"], runs["loop"]
    assert grouped_loss == pytest.approx(loop_loss, rel=1e-5)
    assert sum(g is not None for g in grouped_grads) > len(grouped_grads) // 2
    for a, b in zip(grouped_grads, loop_grads, strict=True):
        assert (a is None) == (b is None)
        assert a is None or ((a - b).norm() / b.norm()).item() <= 1e-4
    # Control: without the seam the experts' adapters would be skipped, silently.
    assert abs(runs["grouped_without_adapters"][0] - loop_loss) > 1e-3 * abs(loop_loss)


def test_router_expert_bias_stays_frozen(pg):
    """An aux-loss-free router's expert bias is part of the frozen base (adapter checkpoints and
    PEFT folders do not hold it): megatron-core's per-step bias update must leave it alone."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config

    config = small_config(
        "[*E]{2}", moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    batch = model_inputs()
    moved = {}
    for adapted in (False, True):
        torch.manual_seed(0)
        model = build_hybrid(config, "[*E]{2}", pg)
        if adapted:
            apply_lora(model, LoRAConfig(rank=2, alpha=4))
        biases = [m.expert_bias for m in model.modules() if hasattr(m, "expert_bias")]
        assert biases
        before = [b.clone() for b in biases]
        model.train()
        model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"]).sum()
        _update_router_expert_bias([model], config, tp_dp_cp_group=torch.distributed.group.WORLD)
        moved[adapted] = any(not torch.equal(b, a) for b, a in zip(biases, before, strict=True))
    assert moved == {False: True, True: False}  # control: the update moves a trained base's


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
def test_duplicated_te_linear_adapters_follow_sequence_parallelism(sequence_parallel):
    """TransformerEngine's duplicated ``TELinear`` (MLA's down-projections) has no TP group,
    but under sequence parallelism its input is sequence-sharded: megatron-core marks its
    weight ``sequence_parallel`` (its gradient is reduced over TP), and the adapter's ``A`` and
    ``B`` need the same, or each TP rank keeps the gradient of its own tokens only."""
    from types import SimpleNamespace

    from megatron_hybrid.peft.adapter import LoRAAdapter
    from megatron_hybrid.peft.linears import _te

    config = SimpleNamespace(
        sequence_parallel=sequence_parallel,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=1,
    )
    module = SimpleNamespace(
        weight=torch.nn.Parameter(torch.zeros(8, 16)),
        _tp_group=None,  # megatron-core passes none to a duplicated TELinear
        explicit_expert_comm=False,
        config=config,
    )
    info = _te(None)(module)
    assert (info.mode, info.sequence_parallel) == ("duplicated", sequence_parallel)
    adapter = LoRAAdapter(info, rank=2, scale=1.0, dropout=0.0, blocks=1, onehot=None,
                          in_features=16)  # fmt: skip
    marked = [getattr(p, "sequence_parallel", False) for p in (adapter.a(), adapter.b())]
    assert marked == [sequence_parallel] * 2
    assert not any(p.tensor_model_parallel for p in (adapter.a(), adapter.b()))


class _FakeGroup:
    """A process group of two ranks as the adapter's forward reads it (size and rank)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    "te_mode, explicit, sequence_parallel",
    [(None, True, False), ("column", False, True)],
    ids=["sequential-expert", "column-layer"],
)
def test_te_column_linear_reads_its_communication_from_te(te_mode, explicit, sequence_parallel):
    """A ``TEColumnParallelLinear`` of ``SequentialMLP``'s experts at TP2 (expert-TP 2, EP 1)
    under sequence parallelism: megatron-core 0.19.2 hands it to TE with ``parallel_mode=None``
    (the dispatcher does its TP communication) but marks its weight ``allreduce=True`` (EP is
    1), and keeps no ``explicit_expert_comm`` on it. The adapter must neither gather its input
    along the sequence nor change its rows (seen on 2 GPUs: 116 rows against the layer's 58);
    the control is the same class as an ordinary column layer (TE's mode ``column``), whose
    adapter does gather."""
    from types import SimpleNamespace

    from megatron_hybrid.peft.adapter import LoRAAdapter, lora_hook
    from megatron_hybrid.peft.linears import _te

    config = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2,
                             expert_model_parallel_size=1)  # fmt: skip
    weight = torch.nn.Parameter(torch.zeros(8, 16))
    weight.allreduce = True
    layer = SimpleNamespace(weight=weight, _tp_group=_FakeGroup(), parallel_mode=te_mode,
                            config=config)  # fmt: skip
    info = _te("column")(layer)
    assert (info.explicit_comm, info.sequence_parallel) == (explicit, sequence_parallel)
    if not explicit:
        return  # the gathering adapter needs a real TP group; its rows are 2-GPU tests' matter
    module = torch.nn.Linear(16, 8, bias=False)
    module.lora = LoRAAdapter(info, rank=2, scale=1.0, dropout=0.0, blocks=1, onehot=None,
                              in_features=16)  # fmt: skip
    x = torch.randn(5, 16)
    out, _ = lora_hook(module, (x,), {}, (torch.zeros(5, 8), None))
    assert out.shape == (5, 8)


def test_an_adapter_whose_rows_differ_from_the_layer_s_is_named():
    """Where the adapter reads a linear's communication unlike the linear itself (its output
    gathered along the sequence where the layer's is not), the add fails naming the class, the
    shapes and how the adapter read the layer, not with torch's bare broadcast error."""
    from types import SimpleNamespace

    from megatron_hybrid.peft.adapter import LoRAAdapter, lora_hook
    from megatron_hybrid.peft.linears import _te

    config = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=1,
                             expert_model_parallel_size=1)  # fmt: skip
    layer = SimpleNamespace(weight=torch.nn.Parameter(torch.zeros(8, 16)), _tp_group=None,
                            explicit_expert_comm=False, config=config)  # fmt: skip
    adapter = LoRAAdapter(_te(None)(layer), rank=2, scale=1.0, dropout=0.0, blocks=1,
                          onehot=None, in_features=16)  # fmt: skip
    module = torch.nn.Linear(16, 8, bias=False)
    module.lora = adapter
    x = torch.randn(6, 16)
    good = lora_hook(module, (x,), {}, (torch.zeros(6, 8), None))
    assert good[0].shape == (6, 8)
    with pytest.raises(RuntimeError, match=r"LoRA on a Linear: the adapter's output \(6, 8\) "
                       r"does not match the layer's \(3, 8\).*mode='duplicated'"):  # fmt: skip
        lora_hook(module, (x,), {}, (torch.zeros(3, 8), None))

"""HybridStack structure: layer numbers, offsets, megatron-core parity, recompute, MTP, GDN."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config


def _forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs)
    loss.sum().backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        pytest.param("*[*-]E[*E]", [[1], [2, 3], [4], [5, 6]], id="mixed"),
        pytest.param("[*E]{3}", [[1, 2], [3, 4], [5, 6]], id="repeated_group"),
        pytest.param("*-*E", [[1], [2], [3], [4]], id="ungrouped"),
    ],
)
def test_physical_layer_numbers(pg, pattern, expected):
    model = build_hybrid(small_config(pattern), pattern, pg)
    numbers = []
    for item, layer in zip(model.decoder.layer_type_list, model.decoder.layers, strict=True):
        members = layer.layers if isinstance(item, tuple) else [layer]
        numbers.append([member.layer_number for member in members])
    assert numbers == expected
    assert model.decoder.num_layers_per_pipeline_rank == len(expected)


def test_pipeline_stage_offsets(model_parallel):
    """A PP stage's layers carry global physical numbers; its keys use global logical indices."""
    from megatron.core import parallel_state

    pattern = "[*-][*E]|*[*E]"
    pg = model_parallel()
    config = small_config(pattern)
    # Build the second stage as if this were pipeline rank 1 of 2 (no communication needed).
    selection_rank = 1
    from megatron_hybrid.modules import HybridStack, hybrid_stack_spec
    from megatron_hybrid.pattern import parse_pattern, select_pipeline_segment

    parsed = parse_pattern(pattern)
    sel = select_pipeline_segment(parsed, pp_rank=selection_rank, pp_size=2)
    from megatron_hybrid.checkpointing.sharded import CheckpointKeyLayout

    stack = HybridStack(
        config,
        hybrid_stack_spec("local").submodules,
        layer_type_list=sel.items,
        pp_layer_offset=sel.physical_offset,
        pg_collection=pg,
        logical_layer_offset=sel.logical_offset,
        checkpoint_keys=CheckpointKeyLayout.for_pattern(parsed),
    )
    assert [layer.layer_number for _, layer in stack.iter_physical_layers()] == [5, 6, 7]
    keys = {v.key for v in stack.sharded_state_dict("decoder.").values() if hasattr(v, "key")}
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in keys
    assert "decoder.layers.3.mlp.router.weight" in keys
    assert not any(k.startswith("decoder.layers.0.") for k in keys)
    assert parallel_state.is_initialized()


def test_ungrouped_pattern_builds_what_megatron_core_builds(pg):
    """Same modules, parameter names and checkpoint keys as megatron-core's HybridStack."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack as MCoreHybridStack

    from megatron_hybrid.modules import HybridStack, hybrid_stack_spec

    pattern = list("*-*E-")
    config = small_config("*-*E-")
    submodules = hybrid_stack_spec("local", config=config).submodules
    # megatron-core's stack hard-codes a TE final norm, so compare without the final norm.
    ours = HybridStack(
        config, submodules, layer_type_list=pattern, pg_collection=pg, post_process=False
    )
    theirs = MCoreHybridStack(
        config, submodules, layer_type_list=pattern, pg_collection=pg, post_process=False
    )
    assert [type(m).__name__ for m in ours.layers] == [type(m).__name__ for m in theirs.layers]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [layer.layer_number for layer in ours.layers] == [
        layer.layer_number for layer in theirs.layers
    ]

    def keys(stack):
        return sorted(v.key for v in stack.sharded_state_dict("decoder.").values())

    assert keys(ours) == keys(theirs)


def test_ungrouped_final_norm_keeps_megatron_key(pg):
    model = build_hybrid(small_config("*-*E"), "*-*E", pg)
    keys = {v.key for v in model.sharded_state_dict().values()}
    assert "decoder.final_norm.weight" in keys
    assert "decoder.layers.3.mlp.router.weight" in keys


RECOMPUTE = [
    pytest.param(
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        id="full_uniform",
    ),
    pytest.param(
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        id="full_block",
    ),
    pytest.param(
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        id="selective_core_attn",
    ),
    pytest.param(
        dict(recompute_granularity="selective", recompute_modules=["mlp"]), id="selective_mlp"
    ),
    pytest.param(
        dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
        id="selective_layernorm",
    ),
]


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_recompute_matches_plain(model_parallel, recompute):
    pattern = "[*-][*E]{2}"
    inputs = model_inputs()
    plain = build_hybrid(small_config(pattern), pattern, model_parallel(seed=5))
    expected = _forward_backward(plain, inputs)
    recomputed = build_hybrid(small_config(pattern, **recompute), pattern, model_parallel(seed=5))
    recomputed.load_state_dict(plain.state_dict())
    actual = _forward_backward(recomputed, inputs)
    assert torch.equal(actual[0], expected[0])
    assert len(actual[1]) == len(expected[1])
    for a, b in zip(actual[1], expected[1], strict=True):
        assert torch.equal(a, b)


def test_mtp_depth_trains(pg):
    pattern = "[*E]{2}/*E"
    model = build_hybrid(small_config(pattern), pattern, pg)
    assert model.mtp_process and len(model.mtp.layers) == 1
    keys = {v.key for v in model.sharded_state_dict().values()}
    assert any(k.startswith("mtp.layers.0.") for k in keys)
    loss, grads = _forward_backward(model, {**model_inputs(), "loss_mask": torch.ones(2, 16)})
    assert torch.isfinite(loss).all()
    mtp_params = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    assert mtp_params and all(p.grad is not None for p in mtp_params)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param(dict(num_layers=3), "num_layers=3", id="num_layers"),
        pytest.param(dict(mtp_num_layers=2), "MTP", id="mtp_depths"),
        pytest.param(dict(moe_grouped_gemm=True), "moe_grouped_gemm", id="grouped_gemm"),
    ],
)
def test_config_mismatch_is_a_clear_error(pg, changes, match):
    from megatron_hybrid.model import HybridModel
    from megatron_hybrid.modules import hybrid_stack_spec

    pattern = "[*E]{2}"
    config = small_config(pattern)
    spec = hybrid_stack_spec("local", config=config)
    bad = dataclasses.replace(config, **changes)
    with pytest.raises(ValueError, match=match):
        HybridModel(bad, spec, 128, 64, hybrid_layer_pattern=pattern, pg_collection=pg)


def test_unsupported_local_dsa_is_a_clear_error(pg):
    from megatron_hybrid.modules import HybridStack, hybrid_stack_spec

    config = small_config("D-")
    with pytest.raises(ValueError, match="need the 'te' backend"):
        HybridStack(
            config,
            hybrid_stack_spec("local").submodules,
            layer_type_list=["D"],
            pg_collection=pg,
            post_process=False,
        )


def test_te_backend_without_te_is_a_clear_error():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    from megatron_hybrid.modules import hybrid_stack_spec

    if HAVE_TE:
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ImportError, match="TransformerEngine"):
        hybrid_stack_spec("te")


def test_gated_delta_net_group_runs_on_cpu(pg):
    pytest.importorskip("fla")
    pattern = "[GE]{2}"
    model = build_hybrid(small_config(pattern), pattern, pg)
    loss, grads = _forward_backward(model, model_inputs())
    assert torch.isfinite(loss).all()
    gdn = [p for n, p in model.named_parameters() if ".self_attention." in n]
    assert gdn and all(p.grad is not None and torch.isfinite(p.grad).all() for p in gdn)
    keys = {v.key for v in model.sharded_state_dict().values()}
    assert "decoder.layers.1.self_attention.in_proj.weight" in keys  # logical, indexed form

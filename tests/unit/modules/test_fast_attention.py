"""SDPA core attention against megatron-core's unfused ``DotProductAttention`` (float32, CPU).

Forward and the gradients of q, k and v must agree to float32 rounding for causal, grouped-query,
explicitly masked, layer-number-scaled and unmasked attention, for MLA's separate head sizes,
and for packed (THD) batches against each sequence run alone. Negative controls: a planted
mistake (a wrong mask, packed sequences placed without their padding) is caught; settings SDPA
cannot express run the reference forward and say why.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from rounding import float32_bounds

from megatron_hybrid.testing.overlap import rel_error

# The floor of the relative error allowed between two float32 evaluations; each result's bound
# is derived from its reference computation (``_over_bound``: the margin times its float32
# rounding scale where that is larger), so it holds on any machine. The negative controls use it.
TOL = 1e-5


def _pair(pg, fast_cls, ref_cls, mask_type=AttnMaskType.causal, **config_overrides):
    from megatron_hybrid.testing.models import small_config

    config = small_config("*", **config_overrides)
    kwargs = dict(config=config, layer_number=3, attn_mask_type=mask_type, attention_type="self",
                  pg_collection=pg)  # fmt: skip
    return fast_cls(**kwargs), ref_cls(**kwargs), config


def _qkv(seq, batch, heads, groups, dim, v_dim=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, heads, dim, generator=gen)
    k = torch.randn(seq, batch, groups, dim, generator=gen)
    v = torch.randn(seq, batch, groups, v_dim or dim, generator=gen)
    return q, k, v


def _run(module, q, k, v, mask=None, rounding=None, **kwargs):
    """Output of ``module`` and the gradients of q, k and v (arithmetic inside ``rounding``)."""
    rounding = rounding or contextlib.nullcontext()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with rounding:
        out = module(*leaves, mask, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))  # set-up: outside
    with rounding:
        out.backward(grad)
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves, strict=True)}}


def _errors(a: dict, b: dict) -> dict:
    return {name: rel_error(a[name], b[name]) for name in b}


def _over_bound(errors: dict[str, float], evaluate) -> list[tuple[str, float, float]]:
    """``(name, relative error, bound)`` of every error over its result's float32 bound.

    Args:
        errors: ``name -> relative error`` of each result against the reference.
        evaluate: ``evaluate(rounding)`` recomputes the reference results from the same inputs,
            their arithmetic inside ``rounding`` (see ``rounding.float32_bounds``).

    Returns:
        The results over ``max(TOL, margin x float32 rounding scale)``; empty if none.
    """
    bounds = float32_bounds(evaluate, measure=rel_error, floor=TOL)
    return [(name, e, bounds[name]) for name, e in errors.items() if not e <= bounds[name]]


CASES = [
    pytest.param({}, 4, None, id="causal"),
    pytest.param({"num_query_groups": 2}, 2, None, id="gqa"),
    pytest.param({"apply_query_key_layer_scaling": True}, 4, None, id="layer-scaling"),
    pytest.param({}, 4, "padding", id="explicit-mask"),
]


@pytest.mark.parametrize("overrides, groups, mask", CASES)
def test_sdpa_matches_dot_product_attention(pg, overrides, groups, mask):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.modules.fast.attention import SDPACoreAttention

    fast, ref, _ = _pair(pg, SDPACoreAttention, DotProductAttention, **overrides)
    q, k, v = _qkv(12, 2, 4, groups, 16)
    attention_mask = None
    if mask == "padding":  # megatron: True = masked; causal plus the last 3 keys of row 1
        attention_mask = torch.ones(12, 12, dtype=torch.bool).triu(1).expand(2, 1, 12, 12).clone()
        attention_mask[1, :, :, 9:] = True
        attention_mask[1, :, :, 0] = False  # every query keeps a key
    errors = _errors(_run(fast, q, k, v, attention_mask), _run(ref, q, k, v, attention_mask))
    assert fast.fast_path_reason is None
    over = _over_bound(errors, lambda rounding: _run(ref, q, k, v, attention_mask, rounding))
    assert not over, f"(name, error, bound) over the bound: {over}"


def test_sdpa_unmasked_attention(pg):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.modules.fast.attention import SDPACoreAttention

    fast, ref, _ = _pair(pg, SDPACoreAttention, DotProductAttention, AttnMaskType.no_mask)
    q, k, v = _qkv(10, 2, 4, 4, 16)
    errors = _errors(_run(fast, q, k, v), _run(ref, q, k, v))
    over = _over_bound(errors, lambda rounding: _run(ref, q, k, v, rounding=rounding))
    assert not over, f"(name, error, bound) over the bound: {over}"


def test_wrong_mask_is_caught(pg):
    """Negative control: SDPA without its causal mask is far from the reference."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.modules.fast.attention import sdpa_attention

    _, ref, _ = _pair(pg, DotProductAttention, DotProductAttention)
    q, k, v = _qkv(12, 2, 4, 4, 16)
    wrong = sdpa_attention(q, k, v, scale=ref.softmax_scale, causal=False)
    assert rel_error(wrong, ref(q, k, v, None)) > 100 * TOL


def test_sdpa_mla_head_sizes(pg):
    from megatron_hybrid.modules.attention import MLACoreAttention
    from megatron_hybrid.modules.fast.attention import SDPAMLACoreAttention
    from megatron_hybrid.testing.models import small_config

    config = small_config("*")
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", softmax_scale=0.3, k_channels=12, v_channels=8,
                  pg_collection=pg)  # fmt: skip
    fast, ref = SDPAMLACoreAttention(**kwargs), MLACoreAttention(**kwargs)
    q, k, v = _qkv(9, 2, 4, 4, 12, v_dim=8)
    fast_out, ref_out = _run(fast, q, k, v), _run(ref, q, k, v)
    assert fast_out["out"].shape == (9, 2, 4 * 8)
    errors = _errors(fast_out, ref_out)
    over = _over_bound(errors, lambda rounding: _run(ref, q, k, v, rounding=rounding))
    assert not over, f"(name, error, bound) over the bound: {over}"


def _packed_params(lengths, padded_lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded_lengths).cumsum(0).tolist()],
                             dtype=torch.int32)  # fmt: skip
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded_lengths),
        max_seqlen_kv=max(padded_lengths),
    )


@pytest.mark.parametrize("bug", [None, "ignore_padding"], ids=["exact", "negative-control"])
def test_packed_sequences_equal_separate_runs(pg, bug):
    """THD: every sequence attends only to itself; padding rows between sequences are zero."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.modules.fast.attention import SDPACoreAttention

    fast, ref, _ = _pair(pg, SDPACoreAttention, DotProductAttention, num_query_groups=2)
    lengths, padded = [5, 1, 7], [8, 4, 8]
    total = sum(padded)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(total, 4, 16, generator=gen)
    k, v = torch.randn(total, 2, 16, generator=gen), torch.randn(total, 2, 16, generator=gen)
    params = _packed_params(lengths, padded if bug is None else lengths + [total - sum(lengths)])
    out = fast(q, k, v, None, packed_seq_params=params)
    assert out.shape == (total, 4 * 16)
    starts = torch.tensor([0, *padded[:-1]]).cumsum(0).tolist()
    parts = [slice(start, start + length) for start, length in zip(starts, lengths, strict=True)]
    # Each sequence alone through the reference (forward only); the slicing is set-up.
    inputs = [(q[part, None], k[part, None], v[part, None]) for part in parts]

    def evaluate(rounding):
        with rounding:
            return {f"seq{i}": ref(*qkv, None).squeeze(1) for i, qkv in enumerate(inputs)}

    alone = evaluate(contextlib.nullcontext())
    errors = {f"seq{i}": rel_error(out[part], alone[f"seq{i}"]) for i, part in enumerate(parts)}
    if bug is None:
        for start, length, width in zip(starts, lengths, padded, strict=True):
            assert torch.all(out[start + length : start + width] == 0)
        over = _over_bound(errors, evaluate)
        assert not over, f"(name, error, bound) over the bound: {over}"
    else:
        assert max(errors.values()) > 100 * TOL, errors


@pytest.mark.parametrize(
    "overrides, kwargs, reason",
    [
        pytest.param({"window_size": (3, 0)}, {}, "sliding-window", id="window"),
        pytest.param({"softmax_type": "off-by-one"}, {}, "softmax_type", id="softmax-sink"),
        pytest.param({}, {"attention_bias": "bias"}, "attention_bias", id="bias"),
    ],
)
def test_unsupported_settings_run_the_reference(pg, overrides, kwargs, reason):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.modules.fast import selection
    from megatron_hybrid.modules.fast.attention import SDPACoreAttention

    fast, ref, _ = _pair(pg, SDPACoreAttention, DotProductAttention, **overrides)
    q, k, v = _qkv(8, 1, 4, 4, 16)
    if kwargs.get("attention_bias"):
        # megatron's local attention refuses a bias itself; only the decision is checked here.
        bias = torch.zeros(1, 4, 8, 8)
        why = selection.sdpa_reason(fast, q, k, None, bias, None, None)
        assert reason in why
        return
    errors = _errors(_run(fast, q, k, v), _run(ref, q, k, v))
    assert reason in fast.fast_path_reason
    assert max(errors.values()) == 0.0  # the very same reference computation


def test_plain_causal_call_takes_the_fast_path(pg):
    """Negative control of the selection: nothing to refuse, so no reason."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.modules.fast import selection
    from megatron_hybrid.modules.fast.attention import SDPACoreAttention

    fast, _, _ = _pair(pg, SDPACoreAttention, DotProductAttention)
    q, k, v = _qkv(8, 1, 4, 4, 16)
    assert selection.sdpa_reason(fast, q, k, None, None, None, None) is None
    longer_keys = torch.randn(10, 1, 4, 16)
    assert "top-left" in selection.sdpa_reason(fast, q, longer_keys, None, None, None, None)
    packed = _packed_params([3, 5], [4, 4])
    assert selection.sdpa_reason(fast, q, k, None, None, None, packed) is None
    packed.cu_seqlens_kv = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert "key lengths differ" in selection.sdpa_reason(fast, q, k, None, None, None, packed)


def test_host_offsets_are_read_once_per_tensor():
    from megatron_hybrid.padding.batch import host_values

    first = torch.tensor([0, 3, 5])
    assert host_values(first) == [0, 3, 5]
    first[1] = 4  # a cached copy keeps 3: the cache is per tensor, read once per batch
    assert host_values(first) == [0, 3, 5]
    assert host_values(torch.tensor([0, 4, 5])) == [0, 4, 5]

"""Packed (THD) attention through one varlen call against one SDPA call per sequence (CPU).

torch's ``varlen_attn`` is a CUDA FlashAttention kernel, so here a stand-in with its contract
(segments given by offsets, causal as ``is_causal`` or ``window_size=(-1, 0)``, grouped-query
heads with or without ``enable_gqa``) computes each segment with SDPA: what is checked is the
package's side of the call (the segments it hands over, pad rows between sequences and after
the last one, their output zeroed, both signatures, key/value heads shared as megatron shares
them), output and gradients, float32. The kernel itself is checked against SDPA on GPUs
(``tests/functional/test_fast_path_gpu.py``), and at first use by ``varlen_probe``, whose
verdicts are checked here with the stand-in too. Negative control: a kernel that ignores the
offsets (one sequence over the whole row) is caught, by the comparison and by the probe.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import functional

from megatron_hybrid.modules.fast import attention, selection
from megatron_hybrid.testing.overlap import rel_error

TOL = 1e-5  # float32 both ways; the same sums in another order


def _fake_varlen(style: str, ignore_offsets: bool = False, max_is_row: bool = False):
    """A stand-in for ``varlen_attn`` with the signature of ``style`` ("window" or "is_causal").

    ``max_q`` must be the longest segment, or with ``max_is_row`` the row's length (fixed-size
    boundaries, whose longest segment is not known on the host)."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, gqa):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
        bounds = [0, q.shape[0]] if ignore_offsets else cu_q.tolist()
        assert bounds[-1] == q.shape[0], "the segments must cover the row"
        longest = max(b - a for a, b in itertools.pairwise(bounds))
        assert max_q == (q.shape[0] if max_is_row else longest) or ignore_offsets
        if k.shape[1] != q.shape[1]:
            assert gqa, "grouped key/value heads without enable_gqa"
        out = []
        for a, b in itertools.pairwise(bounds):
            part = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            out.append(
                functional.scaled_dot_product_attention(
                    *part, is_causal=causal, scale=scale, enable_gqa=gqa
                ).transpose(0, 1)
            )
        return torch.cat(out)

    if style == "window":

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None,
                        window_size=(-1, -1), enable_gqa=False):  # fmt: skip
            assert window_size in ((-1, 0), (-1, -1))
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                          causal=window_size == (-1, 0), gqa=enable_gqa)  # fmt: skip

    else:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, *, scale=None):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=is_causal,
                          gqa=False)  # fmt: skip

    return varlen_attn


@pytest.fixture
def fake_kernel(monkeypatch):
    """Install a stand-in kernel and let the selection choose it on the CPU."""
    import torch.nn.attention.varlen as varlen

    def install(style: str, ignore_offsets: bool = False, max_is_row: bool = False):
        kernel = _fake_varlen(style, ignore_offsets, max_is_row)
        monkeypatch.setattr(varlen, "varlen_attn", kernel)
        selection.varlen_parameters.cache_clear()
        monkeypatch.setattr(attention, "varlen_reason", lambda *a, **k: None)
        monkeypatch.setattr(attention, "varlen_probe", lambda *a, **k: None)

    yield install
    selection.varlen_parameters.cache_clear()


def _params(lengths: list[int], padded: list[int] | None):
    from megatron.core.packed_seq_params import PackedSeqParams

    def offsets(sizes):
        return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)

    cu = offsets(lengths)
    cu_padded = offsets(padded) if padded is not None else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded)  # fmt: skip


LAYOUTS = {
    "back-to-back": ([5, 1, 7], None, 13),
    "padded-apart": ([5, 1, 7], [8, 4, 8], 20),
    "rows-after-the-last": ([5, 1, 7], None, 16),
    "padded-and-rows-after": ([6, 3], [8, 4], 16),
}


def _run(attend, total: int, groups: int, seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(total, heads, 16, generator=gen).requires_grad_()
              for heads in (4, groups, groups)]  # fmt: skip
    out = attend(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves, strict=True)}}


@pytest.mark.parametrize("style", ["window", "is_causal"])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_varlen_call_equals_one_sdpa_call_per_sequence(fake_kernel, style, groups, layout):
    lengths, padded, total = LAYOUTS[layout]
    params = _params(lengths, padded)
    host = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    starts = None if padded is None else [0, *torch.tensor(padded).cumsum(0).tolist()]
    per_sequence = _run(lambda q, k, v: attention.packed_attention_per_sequence(
        q, k, v, host, starts, scale=0.3, causal=True), total, groups)  # fmt: skip
    fake_kernel(style)
    varlen = _run(lambda q, k, v: attention.sdpa_packed_attention(
        q, k, v, params, scale=0.3, causal=True), total, groups)  # fmt: skip
    errors = {name: rel_error(varlen[name], ref) for name, ref in per_sequence.items()}
    assert max(errors.values()) < TOL, errors
    pad = per_sequence["out"].abs().sum(dim=1) == 0
    assert bool(pad.any()) == (layout != "back-to-back")
    for name in varlen:  # pad rows: zero output and zero gradients, exactly
        assert torch.count_nonzero(varlen[name][pad]) == 0, name


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fixed_size_boundaries_need_no_host_read(fake_kernel, monkeypatch, groups, layout):
    """Fixed-size boundaries (what CUDA graphs replay: empty sequences to a power-of-two count)
    go to one varlen call told the row's length as its longest sequence, and give what one SDPA
    call per sequence gives; nothing is read on the host (host_values and the per-sequence path
    raise)."""
    from megatron_hybrid.padding.fixed import FixedPackedSeqParams, fixed_capacity_params

    lengths, padded, total = LAYOUTS[layout]
    params = _params(lengths, padded)
    params.total_tokens = total
    fixed = fixed_capacity_params(params)
    assert isinstance(fixed, FixedPackedSeqParams) and fixed.capacity == 8
    host = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    starts = None if padded is None else [0, *torch.tensor(padded).cumsum(0).tolist()]
    per_sequence = _run(lambda q, k, v: attention.packed_attention_per_sequence(
        q, k, v, host, starts, scale=0.3, causal=True), total, groups)  # fmt: skip
    fake_kernel("window", max_is_row=True)

    def no_host_read(*args, **kwargs):
        raise AssertionError("fixed-size boundaries were read on the host")

    monkeypatch.setattr(attention, "host_values", no_host_read)
    monkeypatch.setattr(attention, "packed_attention_per_sequence", no_host_read)
    varlen = _run(lambda q, k, v: attention.sdpa_packed_attention(
        q, k, v, fixed, scale=0.3, causal=True), total, groups)  # fmt: skip
    errors = {name: rel_error(varlen[name], ref) for name, ref in per_sequence.items()}
    assert max(errors.values()) < TOL, errors


def test_fixed_size_boundaries_of_another_row_are_refused(fake_kernel):
    """Boundaries made for a row of another length (``total_tokens``): their segments would not
    cover the row, so the call says so before any kernel runs."""
    from megatron_hybrid.padding.fixed import fixed_capacity_params

    lengths, padded, total = LAYOUTS["rows-after-the-last"]
    params = _params(lengths, padded)
    params.total_tokens = total + 4
    fake_kernel("window", max_is_row=True)
    q = torch.zeros(total, 4, 16)
    with pytest.raises(ValueError, match="a row of 20 tokens given 16 rows"):
        attention.sdpa_packed_attention(q, q, q, fixed_capacity_params(params), scale=0.3,
                                        causal=True)  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fixed_size_boundaries_per_sequence_skip_the_empty_ones(layout):
    """Without the varlen kernel (the CPU), fixed-size boundaries run the per-sequence calls
    (read on the host, eager), the empty sequences at the end skipped: bitwise the variable
    boundaries' result."""
    from megatron_hybrid.padding.fixed import fixed_capacity_params

    lengths, padded, total = LAYOUTS[layout]
    params = _params(lengths, padded)
    params.total_tokens = total
    fixed = fixed_capacity_params(params)
    results = [_run(lambda q, k, v, p=p: attention.sdpa_packed_attention(
        q, k, v, p, scale=0.3, causal=True), total, 2) for p in (params, fixed)]  # fmt: skip
    for name, ref in results[0].items():
        assert torch.equal(results[1][name], ref), name


def test_negative_control_a_kernel_that_ignores_the_offsets(fake_kernel):
    lengths, padded, total = LAYOUTS["back-to-back"]
    params = _params(lengths, padded)
    host = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    reference = _run(lambda q, k, v: attention.packed_attention_per_sequence(
        q, k, v, host, scale=0.3, causal=True), total, 4)  # fmt: skip
    fake_kernel("window", ignore_offsets=True)
    leaking = _run(lambda q, k, v: attention.sdpa_packed_attention(
        q, k, v, params, scale=0.3, causal=True), total, 4)  # fmt: skip
    assert rel_error(leaking["out"], reference["out"]) > 100 * TOL


def test_varlen_reason_names_what_keeps_the_per_sequence_calls(monkeypatch):
    q = torch.zeros(8, 4, 16)
    monkeypatch.setenv("MEGATRON_HYBRID_VARLEN", "0")
    assert "turned off (MEGATRON_HYBRID_VARLEN=0)" == selection.varlen_reason(
        q, q, causal=True, dropout_p=0.0, gaps=False
    )
    monkeypatch.delenv("MEGATRON_HYBRID_VARLEN")  # on by default
    assert "CUDA kernel" in selection.varlen_reason(q, q, causal=True, dropout_p=0.0, gaps=False)


@pytest.mark.parametrize(
    "kernel, verdict",
    [
        pytest.param("right", None, id="right"),
        pytest.param("ignores-offsets", "differs from SDPA in its output", id="wrong"),
        pytest.param("raises", "does not run on cpu in torch.float32: no kernel", id="raises"),
    ],
)
def test_probe_verdicts_even_under_no_grad(monkeypatch, kernel, verdict):
    import torch.nn.attention.varlen as varlen

    def raising(*args, **kwargs):
        raise RuntimeError("no kernel")

    fake = raising if kernel == "raises" else _fake_varlen("window", kernel != "right")
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    selection.varlen_parameters.cache_clear()
    attention.varlen_probe.cache_clear()
    try:
        with torch.no_grad():  # forward_logprobs' forward-only schedule calls it so
            found = attention.varlen_probe(torch.device("cpu"), torch.float32)
    finally:
        attention.varlen_probe.cache_clear()
        selection.varlen_parameters.cache_clear()
    assert found == verdict if verdict is None else verdict in found, found

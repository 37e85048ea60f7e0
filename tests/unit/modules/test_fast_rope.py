"""RoPE in three kernels each way against megatron-core's unfused ``_apply_rotary_pos_emb_bshd``
and, for packed rows, ``_apply_rotary_pos_emb_thd``.

``apply_rope`` must give megatron's output and input gradient (float32 to rounding, bfloat16
within its rounding), with the whole head rotated or only part of it and with a YaRN-style
scale; its tables are built once per frequency tensor. ``apply_rope_thd`` must give megatron's
THD RoPE (positions restarting per sequence, padded offsets, frequencies covering the whole row)
without reading anything on the host, and a packed ``[*-]`` model on the fast path the reference
model's logits and gradients. ``FastSelfAttention`` leaves what it does not cover to megatron
with a reason. Negative controls: the sine's sign flipped; positions that do not restart;
megatron's THD RoPE, which reads the host.
"""

from __future__ import annotations

import types

import pytest
import torch
from support.mla import mla_config
from support.triton_interpreter import run_under_interpreter

from megatron_hybrid.testing.overlap import rel_error


def _freqs(seq: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _run(fn, t: torch.Tensor, grad: torch.Tensor):
    x = t.detach().clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


CASES = [
    pytest.param(32, 1.0, id="full"),
    pytest.param(16, 1.0, id="partial"),
    pytest.param(32, 1.3, id="mscale"),
]


@pytest.mark.parametrize("rot, mscale", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_rope_equals_megatrons(rot, mscale, dtype, tol):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_hybrid.modules.fast.rope import apply_rope

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(24, 2, 4, 32, generator=gen).to(dtype)
    grad = torch.randn(24, 2, 4, 32, generator=gen).to(dtype)
    freqs = _freqs(24, rot)
    ours = _run(lambda x: apply_rope(x, freqs, mscale), t, grad)
    theirs = _run(lambda x: _apply_rotary_pos_emb_bshd(x, freqs, mscale=mscale), t, grad)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and rel_error(a, b) < tol


def test_flipped_sine_is_caught():
    """Negative control: rotating the other way."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_hybrid.modules.fast import rope

    t, freqs = torch.randn(24, 2, 4, 32), _freqs(24, 32)
    cos, signed_sin = rope.rope_tables(freqs, t.dtype)
    wrong = rope._Rope.apply(t, cos, -signed_sin)
    assert rel_error(wrong, _apply_rotary_pos_emb_bshd(t, freqs)) > 0.1


def test_tables_are_built_once_per_frequency_tensor():
    from megatron_hybrid.modules.fast import rope

    freqs = _freqs(8, 16)
    first = rope.rope_tables(freqs, torch.float32)
    assert rope.rope_tables(freqs, torch.float32)[0] is first[0]
    freqs.mul_(2.0)  # modified in place: new tables
    assert rope.rope_tables(freqs, torch.float32)[0] is not first[0]
    key = id(freqs)
    del freqs
    assert key not in rope._TABLES


@pytest.mark.parametrize(
    "fields, packed, inference, reason",
    [
        pytest.param({}, None, None, None, id="fused"),
        pytest.param({"apply_rope_fusion": True}, None, None, "apply_rope_fusion", id="te-fused"),
        pytest.param({"rotary_interleaved": True}, None, None, "interleaved", id="interleaved"),
        pytest.param({}, "thd", None, None, id="packed"),
        pytest.param({"cp": 2}, "thd", None, "context-parallel", id="packed-cp2"),
        pytest.param({}, None, object(), "inference", id="inference"),
    ],
)
def test_rope_reason(fields, packed, inference, reason):
    from megatron_hybrid.modules.fast.selection import rope_reason

    cp = fields.pop("cp", 1)
    config = types.SimpleNamespace(**{"apply_rope_fusion": False, "rotary_interleaved": False,
                                      **fields})  # fmt: skip
    group = types.SimpleNamespace(size=lambda: cp)
    module = types.SimpleNamespace(config=config, pg_collection=types.SimpleNamespace(cp=group))
    params = None if packed is None else types.SimpleNamespace(qkv_format=packed)
    found = rope_reason(module, torch.zeros(1), params, inference)
    assert found is None if reason is None else reason in found
    assert rope_reason(module, None, None, None) == "no rotary embedding"


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute-up-proj", "plain"])
def test_mla_rope_reason(recompute):
    """MLA leaves its RoPE to megatron where the backward recomputes the up-projection (which
    runs megatron's RoPE again, outside the forward); else rope_reason's cases decide."""
    from megatron_hybrid.modules.fast.selection import mla_rope_reason

    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=True)
    group = types.SimpleNamespace(size=lambda: 1)
    module = types.SimpleNamespace(config=config, recompute_up_proj=recompute,
                                   rotary_pos_emb=object(),
                                   pg_collection=types.SimpleNamespace(cp=group))  # fmt: skip
    found = mla_rope_reason(module, None, None)
    assert found.startswith("recompute_up_proj" if recompute else "rotary_interleaved")
    config.rotary_interleaved = False
    assert (mla_rope_reason(module, None, None) is None) is not recompute


# Packed rows: sequences of 5, 9, 3 and 11 tokens; padded apart to multiples of 4 (16, 8, 12
# with the padding continuing each sequence) in the padded case.
_OFFSETS = {"plain": [0, 5, 14, 17, 28], "padded": [0, 8, 20, 24, 36]}


def _thd_inputs(layout: str, freq_len: int, rot: int, dtype):
    offsets = torch.tensor(_OFFSETS[layout], dtype=torch.int32)
    tokens = int(offsets[-1])
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(tokens, 1, 4, 32, generator=gen).to(dtype)
    grad = torch.randn(tokens, 1, 4, 32, generator=gen).to(dtype)
    return t, grad, offsets, _freqs(freq_len if freq_len else tokens, rot)


def _megatron_thd(x, freqs, offsets, mscale, cp_group):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    return _apply_rotary_pos_emb_thd(x.squeeze(1), offsets, freqs, mscale=mscale,
                                     cp_group=cp_group).unsqueeze(1)  # fmt: skip


THD_CASES = [
    pytest.param("plain", 16, 32, 1.0, id="restart"),
    pytest.param("padded", 16, 32, 1.0, id="padded-offsets"),
    pytest.param("plain", 16, 16, 1.3, id="partial-mscale"),
    pytest.param("plain", 0, 32, 1.0, id="freqs-cover-the-row"),
]


@pytest.mark.parametrize("layout, freq_len, rot, mscale", THD_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_thd_rope_equals_megatrons(pg, layout, freq_len, rot, mscale, dtype, tol):
    from megatron_hybrid.modules.fast.rope import apply_rope_thd

    t, grad, offsets, freqs = _thd_inputs(layout, freq_len, rot, dtype)
    ours = _run(lambda x: apply_rope_thd(x, freqs, offsets, mscale), t, grad)
    theirs = _run(lambda x: _megatron_thd(x, freqs, offsets, mscale, pg.cp), t, grad)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and rel_error(a, b) < tol
    three_d = apply_rope_thd(t.squeeze(1), freqs, offsets, mscale)  # megatron's THD layout
    assert torch.equal(three_d, ours[0].squeeze(1))


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["mla", "plain"])
def test_mla_rope_equals_megatrons(pg, packed, interleaved):
    """``mla_rope`` against megatron-core's ``apply_rotary_pos_emb`` as MLA calls it (with its
    channel interleaving, a YaRN-style scale), padded and packed; megatron's function is what
    the MLA module sees again after a call, also one that raised."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import multi_latent_attention

    from megatron_hybrid.modules.fast import mla

    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False)
    if packed:
        t, grad, offsets, freqs = _thd_inputs("plain", 16, 32, torch.float32)
        t, grad = t.squeeze(1), grad.squeeze(1)  # MLA's THD tensors are [t, heads, dim]
    else:
        gen = torch.Generator().manual_seed(3)
        t, grad = (torch.randn(24, 2, 4, 32, generator=gen) for _ in range(2))
        offsets, freqs = None, _freqs(24, 32)
    kwargs = dict(cu_seqlens=offsets, mscale=1.3, cp_group=pg.cp,
                  mla_rotary_interleaved=interleaved)  # fmt: skip
    ours = _run(lambda x: mla.mla_rope(x, freqs, config, **kwargs), t, grad)
    theirs = _run(lambda x: apply_rotary_pos_emb(x, freqs, config, **kwargs), t, grad)
    for a, b in zip(ours, theirs, strict=True):
        assert rel_error(a, b) < 1e-6
    if interleaved:  # control: the interleaving left out
        plain = mla.mla_rope(t, freqs, config, **{**kwargs, "mla_rotary_interleaved": False})
        assert rel_error(plain, theirs[0]) > 0.1
    with pytest.raises(ZeroDivisionError):
        with mla._rope_in_megatrons_mla(None):
            assert multi_latent_attention.apply_rotary_pos_emb.func is mla.mla_rope
            raise ZeroDivisionError
    assert multi_latent_attention.apply_rotary_pos_emb is apply_rotary_pos_emb


def test_restart_can_be_forced_where_the_table_is_the_rows_length():
    """Fixed-size boundaries (CUDA graphs) size the table by the row and megatron's MLA cuts it
    to the row's length, where megatron's rule would read whole-row positions: ``restart=True``
    keeps per-sequence positions (those of a longer table). Control: the rule by length."""
    from megatron_hybrid.modules.fast.rope import apply_rope_thd

    t, _, offsets, freqs = _thd_inputs("plain", 16, 32, torch.float32)
    tokens = t.shape[0]
    longer = _freqs(tokens + 1, 32)
    want = apply_rope_thd(t, longer, offsets)
    assert torch.equal(apply_rope_thd(t, longer[:tokens], offsets, restart=True), want)
    assert rel_error(apply_rope_thd(t, longer[:tokens], offsets), want) > 0.1


def test_thd_rope_while_capturing_skips_its_caches(monkeypatch):
    """While a CUDA graph captures, the positions and tables come from the inputs (a replay
    recomputes them): the same rotation, nothing cached. Control: outside capture the cache
    gets its entries."""
    from megatron_hybrid.modules.fast import rope

    t, _, offsets, freqs = _thd_inputs("plain", 16, 32, torch.float32)
    want = rope.apply_rope_thd(t, freqs, offsets)
    assert rope.per_tensor(rope._THD, offsets)  # control: cached outside capture
    fresh = offsets.clone()
    monkeypatch.setattr(rope, "_capturing", lambda tensor: True)
    assert torch.equal(rope.apply_rope_thd(t, freqs, fresh), want)
    assert not rope.per_tensor(rope._THD, fresh)


def test_thd_positions_that_do_not_restart_are_caught(pg):
    """Negative control: the packed row rotated as one sequence."""
    from megatron_hybrid.modules.fast import rope

    t, _, offsets, freqs = _thd_inputs("plain", 28, 32, torch.float32)
    freqs16 = _freqs(16, 32)
    assert rope.thd_positions(offsets, 28).tolist() == [
        *range(5), *range(9), *range(3), *range(11)
    ]  # fmt: skip
    cos, signed_sin = rope.rope_tables(freqs, t.dtype)  # positions 0..27 in a row
    wrong = rope._Rope.apply(t, cos, signed_sin)
    expected = _megatron_thd(t, freqs16, offsets, 1.0, pg.cp)
    assert rel_error(wrong, expected) > 0.1


def test_thd_rope_reads_nothing_on_the_host(pg, monkeypatch):
    """No ``.item()`` / ``.tolist()`` / ``int()`` of a tensor; the control: megatron's does."""
    from megatron_hybrid.modules.fast.rope import apply_rope_thd

    t, _, offsets, freqs = _thd_inputs("padded", 16, 32, torch.float32)

    def host_read(*args, **kwargs):
        raise AssertionError("host read")

    for name in ("item", "tolist", "__int__", "__index__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    apply_rope_thd(t, freqs, offsets)
    with pytest.raises(AssertionError, match="host read"):
        _megatron_thd(t, freqs, offsets, 1.0, pg.cp)


def _packed_config(pattern: str):
    from megatron_hybrid.testing.models import small_config

    config = small_config(pattern)
    return mla_config(config) if "+" in pattern else config


@pytest.mark.parametrize("pattern", ["[*-]", "[+-]"], ids=["attention", "mla"])
def test_packed_fast_model_equals_reference_model(model_parallel, pattern):
    """A packed row (with alignment padding between sequences) through ``[*-]`` and MLA's
    ``[+-]`` on the fast path (SDPA per sequence, THD RoPE on the device; MLA's interleaved
    RoPE channels) and on the reference path: logits and every gradient to float32 rounding;
    the fast attention ran its own RoPE."""
    from support.packing import pack_with_gaps, random_sequences

    from megatron_hybrid.model import HybridModel
    from megatron_hybrid.modules import hybrid_stack_spec
    from megatron_hybrid.padding import packed_seq_params_to

    pg = model_parallel(seed=3)
    packed = pack_with_gaps(random_sequences((5, 17, 9, 30)))
    tensors = packed.tensors
    results = {}
    for impl in ("reference", "fast"):
        config = _packed_config(pattern)
        torch.manual_seed(1)
        model = HybridModel(config, hybrid_stack_spec("local", config=config, local_impl=impl),
                            vocab_size=128, max_sequence_length=64, hybrid_layer_pattern=pattern,
                            pg_collection=pg, position_embedding_type="rope")  # fmt: skip
        logits = model(tensors["input_ids"], tensors["position_ids"], None,
                       packed_seq_params=packed_seq_params_to(packed.packed_seq_params, "cpu"),
                       padding_mask=tensors["padding_mask"])  # fmt: skip
        real = ~tensors["padding_mask"]
        logits[real].float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (logits[real].detach(), grads, model)
    (ref_logits, ref_grads, _), (logits, grads, fast) = results["reference"], results["fast"]
    attention = next(m for n, m in fast.named_modules() if n.endswith("self_attention"))
    assert attention.fast_path_reason is None
    assert rel_error(logits, ref_logits) < 1e-5
    assert grads.keys() == ref_grads.keys()
    assert max(rel_error(grads[n], g) for n, g in ref_grads.items()) < 1e-5


_UNDER_INTERPRETER = """
import torch
from megatron_hybrid.modules.fast import rope

gen = torch.Generator().manual_seed(0)


def freqs(seq, rot):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


worst = 0.0
# Whole and partial rotation; tables per sequence position or per (position, sample); the
# rotated tensor a strided view (a query sliced out of a fused projection).
for rot, batch_tables in ((32, False), (16, False), (32, True)):
    fused = torch.randn(12, 3, 5, 3 * 32, generator=gen)
    t = fused[..., 32:64].requires_grad_()
    f = freqs(12, rot)
    if batch_tables:
        f = f.expand(12, 3, 1, rot) * torch.rand(1, 3, 1, 1, generator=gen)
    cos, signed_sin = rope.rope_tables(f.contiguous(), t.dtype)
    grad = torch.randn(12, 3, 5, 32, generator=gen)
    ours = rope._RopeKernel.apply(t, cos, signed_sin)
    (d_ours,) = torch.autograd.grad(ours, t, grad)
    assert ours.is_contiguous()
    t_ref = t.detach().clone().requires_grad_()
    if rot == 32:
        ref = rope._Rope.apply(t_ref, cos, signed_sin)
    else:
        ref = torch.cat((rope._Rope.apply(t_ref[..., :rot], cos, signed_sin), t_ref[..., rot:]), -1)
    (d_ref,) = torch.autograd.grad(ref, t_ref, grad)
    worst = max(worst, float((ours - ref).abs().max()), float((d_ours - d_ref).abs().max()))
    assert torch.equal(ours[..., rot:], t.detach()[..., rot:])
assert worst < 1e-5, worst
# Control: the sine's sign flipped is seen.
flipped = rope._RopeKernel.apply(t.detach(), cos, -signed_sin)
assert float((flipped - rope._Rope.apply(t.detach(), cos, signed_sin)).abs().max()) > 0.1
print("triton rope ok", worst)
"""


@pytest.mark.slow
def test_triton_rope_under_interpreter(tmp_path):
    """The Triton rotation (what CUDA runs, forward and backward) on Triton's CPU interpreter
    equals the torch operators' in float32: whole and partial rotation (the rest passed through
    bit for bit), tables per position or per position and sample, a strided input. Control: the
    sine's sign flipped."""
    pytest.importorskip("triton.runtime.interpreter")
    run_under_interpreter(_UNDER_INTERPRETER, tmp_path, "triton rope ok")


def _tables(layout: str):
    """``(t, cos, signed_sin)`` on the CPU in one of the layouts the kernel check tells apart."""
    t = torch.zeros(4, 2, 3, 8)
    freqs = _freqs(4, 8)
    if layout == "batch-major":  # [b, s, 1, rot] transposed: cos keeps that layout
        freqs = freqs.expand(4, 2, 1, 8).transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "odd":
        freqs = freqs[..., :7]
    elif layout == "wider":
        freqs = torch.cat((freqs, freqs), -1)
    from megatron_hybrid.modules.fast.rope import rope_tables

    return (t, *rope_tables(freqs, t.dtype))


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ("plain", "not on CUDA"),
        ("batch-major", "the sine table does not lie as the cosine table does"),
        ("odd", "7 rotated channels of 8"),
        ("wider", "16 rotated channels of 8"),
    ],
    ids=["plain", "batch-major", "odd-rotation", "wider-than-the-head"],
)
def test_rope_kernel_reason(layout, reason):
    """Tables the kernel would misread (a sine table laid out unlike the cosine one, read at
    the cosine's strides) or a rotation it cannot do go to the torch operators, with why."""
    from megatron_hybrid.modules.fast.rope import rope_kernel_reason

    got = rope_kernel_reason(*_tables(layout))
    assert got is not None and got.startswith(reason), got

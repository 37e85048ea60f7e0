"""megatron-core's Mamba kernels against the torch Mamba2 path, float32 and bf16, on one GPU.

Both mixers are built from the same seed, so they hold bitwise the same weights (checked first);
then one forward and backward with the same input and upstream gradient. The reference is the
torch path (``TorchMambaMixer``, eager) in float32 with TF32 off (itself checked against a
token-by-token recurrence in ``tests/unit/modules/test_mamba_torch.py``). The tables give the
norm-relative error of the output, the input gradient and every parameter gradient.

The fast path's compiled torch Mamba2 (``FastTorchMambaMixer``, which ``local_impl="auto"``
picks on a GPU) is checked in bf16 against the same eager float32 reference, at both lengths
(``test_fast_path_gpu.py`` runs it in a whole model at one length). Each length and dtype
compiled is a graph of its own (seconds each), so only bf16 compiles here.

Tolerances: the yardstick is the torch path run in bf16 (its float32 arithmetic on bf16 weights
and activations: only rounding). mamba_ssm's kernels may round a few more intermediates, so in
bf16 they must stay within a small multiple of it plus a floor; in float32 within a bound that
allows TF32 products inside the Triton kernels (unit roundoff 2^-11). A wrong kernel or a wrong
torch path (grouping, skip, gate) is off by O(1).

Needs mamba_ssm and causal_conv1d; without them the kernel comparison is skipped with the reason
and only the torch path's bf16-vs-float32 check runs. Run with ``torchrun --nproc_per_node 1``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import exact_float32, rel_error, report

HIDDEN, HEAD_DIM, STATE, GROUPS, BATCH = 128, 32, 32, 2, 2  # 8 heads
SEQS = pytest.mark.parametrize("seq", [256, 200], ids=["2-chunks", "ragged"])
# Kernels in float32: TF32 products in Triton's dots (2^-11 = 4.9e-4 per product, ~1e-3 in a
# norm); the cancelling dA_log/ddt_bias sums amplify it, hence more room than that.
FP32_KERNEL_TOL = 2e-2
# The bf16 torch path only rounds (unit roundoff 2^-8, ~5e-3 in a norm, measured on the CPU).
# The gradients of A_log and dt_bias are sums over B*T of terms that largely cancel, so their
# rounding error is relatively larger (measured up to 2.9e-2): above these the path itself is off.
BF16_ROUNDING_TOL = {None: 1e-2, "dA_log": 6e-2, "ddt_bias": 6e-2}
# Kernels in bf16: a few yardsticks plus a floor (gradients reduced over B*T in another order).
BF16_FACTOR, BF16_FLOOR = 4.0, 1e-2


@pytest.fixture
def pg(world):
    from megatron_hybrid.process_groups import (
        initialize_model_parallel,
        reset_megatron_state,
    )

    yield initialize_model_parallel(tp=1, seed=1)
    reset_megatron_state()


def _mixer(pg, impl: str, dtype: torch.dtype, device, local_impl: str = "reference"):
    """A Mamba mixer: megatron-core's kernels (``impl="kernels"``) or the torch path, eager
    (``local_impl="reference"``) or compiled (``"fast"``)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hybrid import hybrid_stack_spec
    from megatron_hybrid.testing.models import small_config

    config = small_config(
        "M",
        hidden_size=HIDDEN,
        mamba_head_dim=HEAD_DIM,
        mamba_state_dim=STATE,
        mamba_num_groups=GROUPS,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )
    spec = hybrid_stack_spec("local", config=config, mamba_impl=impl, local_impl=local_impl)
    mixer_spec = spec.submodules.mamba_layer.submodules.mixer
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5)
    return build_module(mixer_spec, config, d_model=HIDDEN, pg_collection=pg).to(device)


def _run(mixer, seq: int, device, dtype, packed=None) -> dict[str, torch.Tensor]:
    """One forward and backward: ``[seq, BATCH]`` rows, or with ``packed`` (a
    ``PackedSeqParams``) one ``[seq, 1]`` row of packed sequences."""
    batch = BATCH if packed is None else 1
    gen = torch.Generator().manual_seed(seq)
    hidden = torch.randn(seq, batch, HIDDEN, generator=gen).to(device, dtype).requires_grad_()
    grad_out = torch.randn(seq, batch, HIDDEN, generator=gen).to(device, dtype)
    out, _ = mixer(hidden, packed_seq_params=packed)
    out.backward(grad_out)
    # Copies: a float32 gradient's .float() is the gradient itself, which a later run of the
    # same mixer would add to.
    grads = {f"d{n}": p.grad.float().clone() for n, p in mixer.named_parameters()}
    return {"out": out.detach().float(), "dhidden": hidden.grad.float(), **grads}


def _errors(actual: dict, reference: dict) -> dict[str, float]:
    assert actual.keys() == reference.keys()
    return {name: rel_error(actual[name], reference[name]) for name in reference}


def _copy_weights(target, source) -> None:
    """``source``'s weights into ``target`` (rounded to its dtypes)."""
    with torch.no_grad():
        for param, value in zip(target.parameters(), source.parameters(), strict=True):
            param.copy_(value)


def _check(errors: dict[str, float], bounds: dict[str, float]) -> None:
    assert all(errors[n] < bounds[n] for n in errors), (errors, bounds)


@SEQS
def test_torch_path_bf16_only_rounds(pg, world, seq):
    """The torch path in bf16, eager and compiled (the fast path's), is the float32 function up
    to bf16 rounding (runs without kernels)."""
    from megatron_hybrid.modules.fast.mamba import FastTorchMambaMixer

    device = world[2]
    fp32_mixer = _mixer(pg, "torch", torch.float32, device)
    bf16_mixer = _mixer(pg, "torch", torch.bfloat16, device)
    compiled = _mixer(pg, "torch", torch.bfloat16, device, local_impl="fast")
    assert type(bf16_mixer) is not FastTorchMambaMixer and isinstance(compiled, FastTorchMambaMixer)
    # torch's initialisers draw differently per dtype: the bf16 mixers get fp32's weights rounded.
    _copy_weights(bf16_mixer, fp32_mixer)
    _copy_weights(compiled, fp32_mixer)
    with exact_float32():
        reference = _run(fp32_mixer, seq, device, torch.float32)
    bf16 = _errors(_run(bf16_mixer, seq, device, torch.bfloat16), reference)
    fast = _errors(_run(compiled, seq, device, torch.bfloat16), reference)
    assert compiled.fast_path_reason is None, f"not compiled: {compiled.fast_path_reason}"
    report(f"torch path bf16 vs float32, T={seq}", [("tensor", "eager", "compiled")]
           + [(n, f"{bf16[n]:.2e}", f"{fast[n]:.2e}") for n in sorted(bf16)])  # fmt: skip
    bounds = {n: BF16_ROUNDING_TOL.get(n, BF16_ROUNDING_TOL[None]) for n in bf16}
    _check(bf16, bounds)
    _check(fast, bounds)


def _packed_params(lengths: list[int], device):
    """megatron's ``PackedSeqParams`` of one row of sequences of ``lengths`` (its
    ``__post_init__`` derives ``seq_idx`` from ``total_tokens``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
                           total_tokens=sum(lengths))  # fmt: skip


def test_compiled_torch_path_takes_packed_sequences(pg, world):
    """The fast path's compiled Mamba2 on a packed row (``seq_idx`` into the compiled scan) is
    the eager float32 function on the same row up to bf16 rounding. Sequences cross the
    chunk boundary (chunk 128) and start inside chunks. Control: the same row read
    as one sequence (no ``seq_idx``) is far from the packed reference, so the boundaries the
    comparison checks matter."""
    from megatron_hybrid.modules.fast.mamba import FastTorchMambaMixer

    device = world[2]
    lengths = [37, 64, 90, 20, 45]
    packed = _packed_params(lengths, device)
    fp32_mixer = _mixer(pg, "torch", torch.float32, device)
    compiled = _mixer(pg, "torch", torch.bfloat16, device, local_impl="fast")
    assert isinstance(compiled, FastTorchMambaMixer)
    _copy_weights(compiled, fp32_mixer)
    seq = sum(lengths)
    with exact_float32():
        reference = _run(fp32_mixer, seq, device, torch.float32, packed)
        as_one = _run(fp32_mixer, seq, device, torch.float32, _packed_params([seq], device))
    fast = _errors(_run(compiled, seq, device, torch.bfloat16, packed), reference)
    assert compiled.fast_path_reason is None, f"not compiled: {compiled.fast_path_reason}"
    control = rel_error(as_one["out"], reference["out"])
    report(f"compiled torch path, packed row {lengths}, bf16 vs float32",
           [("tensor", "compiled")] + [(n, f"{fast[n]:.2e}") for n in sorted(fast)]
           + [("control: one sequence, out", f"{control:.2e}")])  # fmt: skip
    _check(fast, {n: BF16_ROUNDING_TOL.get(n, BF16_ROUNDING_TOL[None]) for n in fast})
    assert control > 3 * BF16_ROUNDING_TOL[None], control


@SEQS
def test_kernels_match_torch_path(pg, world, seq):
    from megatron_hybrid.modules.mamba_torch import mamba_kernels_available

    available, reason = mamba_kernels_available()
    if not available:
        pytest.skip(f"megatron-core's Mamba kernels cannot run here: {reason}")
    device = world[2]
    reference_mixer = _mixer(pg, "torch", torch.float32, device)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        kernels = _mixer(pg, "kernels", dtype, device)
        torch_path = _mixer(pg, "torch", dtype, device)
        for (name, a), b in zip(
            kernels.state_dict().items(), torch_path.state_dict().values(), strict=True
        ):
            if torch.is_tensor(a):
                assert torch.equal(a, b), f"{name}: the two classes initialised differently"
        for mixer in (kernels, torch_path):
            _copy_weights(mixer, reference_mixer)
        with exact_float32():
            results[dtype] = {
                "kernels": _run(kernels, seq, device, dtype),
                "torch": _run(torch_path, seq, device, dtype),
            }
    reference = results[torch.float32]["torch"]
    fp32 = _errors(results[torch.float32]["kernels"], reference)
    yardstick = _errors(results[torch.bfloat16]["torch"], reference)
    bf16 = _errors(results[torch.bfloat16]["kernels"], reference)
    report(
        f"Mamba kernels vs torch path (float32 reference), T={seq}",
        [("tensor", "kernels fp32", "torch bf16", "kernels bf16")]
        + [(n, f"{fp32[n]:.2e}", f"{yardstick[n]:.2e}", f"{bf16[n]:.2e}") for n in reference],
    )
    _check(fp32, {n: FP32_KERNEL_TOL for n in fp32})
    _check(bf16, {n: BF16_FACTOR * yardstick[n] + BF16_FLOOR for n in bf16})

"""Float32 products on TF32 tensor cores, for one operation rather than the whole process.

cuBLAS multiplies float32 matrices with FFMA instructions unless TF32 is allowed. The torch
Mamba2 scan (:func:`~megatron_hybrid.modules.ssd.ssd_chunk_scan`) keeps its chunked products in
float32, and at ``benchmarks/mfu.py``'s issue shape those FFMA GEMMs
(``sm80_xmma_gemm_f32f32_f32f32_f32_*_ffma``) took about 52 ms of a 0.274 s ``[ME]`` step
(one H200, 2026-11-29). mamba_ssm's kernels, which megatron-core's ``MambaMixer`` runs, compute
the same products with bfloat16 operands and float32 accumulators (mamba_ssm 2.x,
``ops/triton/ssd_chunk_scan.py``: ``tl.dot`` on operands cast to the input dtype); TF32 keeps
10 bits of each operand's mantissa where bfloat16 keeps 7, so TF32 products lie between that and
float32.

Torch's TF32 switch (``torch.backends.cuda.matmul.fp32_precision``) is one flag for the process:
turning it on for the run would also change every other float32 matmul (a float32 router's
logits, a user's own). :func:`tf32_bmm` is a custom operator that sets the flag around its own
cuBLAS call and puts back what was there, in its forward and in both products of its backward
(which call the operator again); TorchDynamo and inductor see it as one opaque node, so the
switch is not traced away, and it may be captured in CUDA graphs (the flag is read when the call
is made). It sets TF32 whatever the flag was: the caller decides (the fast Mamba path, with its
own switch). While the call is made the flag is the process's, so a float32 matmul launched by
another thread in that moment could take TF32 too; calls of the operator hold a lock, so that
two threads cannot put back each other's values. ``NVIDIA_TF32_OVERRIDE=0`` in the environment
(cuBLAS's own switch) keeps every product float32. On other devices it is ``torch.bmm``.
:func:`contract` is a two-operand ``torch.einsum`` whose product goes through it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["contract", "tf32_bmm", "tf32_matmuls"]

_FLAG_LOCK = threading.RLock()


@contextmanager
def tf32_matmuls() -> Iterator[None]:
    """cuBLAS float32 matmuls on TF32 inside the block; the flag as it was after it.

    Saved and put back through the same API (``fp32_precision``), so a process that set the
    flag either way (``allow_tf32`` or ``fp32_precision``) reads it as it left it; one thread
    at a time.
    """
    settings = torch.backends.cuda.matmul
    with _FLAG_LOCK:
        before = settings.fp32_precision
        settings.fp32_precision = "tf32"
        try:
            yield
        finally:
            settings.fp32_precision = before


@torch.library.custom_op("megatron_hybrid::tf32_bmm", mutates_args=())
def tf32_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` with TF32 products on CUDA (float32 operands; others as bmm)."""
    if not a.is_cuda:
        return torch.bmm(a, b)
    with tf32_matmuls():
        return torch.bmm(a, b)


@tf32_bmm.register_fake
def _tf32_bmm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _tf32_bmm_backward(ctx, grad: torch.Tensor):
    a, b = ctx.saved_tensors
    grad_a = tf32_bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
    grad_b = tf32_bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


tf32_bmm.register_autograd(_tf32_bmm_backward, setup_context=_save)


def contract(spec: str, a: torch.Tensor, b: torch.Tensor, *, tf32: bool) -> torch.Tensor:
    """``torch.einsum(spec, a, b)``; with ``tf32`` the product is :func:`tf32_bmm`.

    With ``tf32`` the operands are laid out as one batched product (indices in both operands and
    the output are its batch, those in both and not the output are summed), so ``spec`` may not
    sum over an index of one operand alone or repeat an index within an operand, and an index
    has one size in both; ``torch.einsum`` takes ``spec`` as it is otherwise.

    Raises:
        ValueError: with ``tf32``, a ``spec`` of another form.
    """
    if not tf32:
        return torch.einsum(spec, a, b)
    inputs, out = spec.replace(" ", "").split("->")
    left, right = inputs.split(",")
    alone = (set(left) ^ set(right)) - set(out)
    if alone or len(set(left)) < len(left) or len(set(right)) < len(right):
        raise ValueError(
            f"contract({spec!r}) with tf32 takes two operands, no index repeated in one and none "
            f"summed in one alone ({''.join(sorted(alone)) or 'a repeated index'}); use "
            "torch.einsum for it"
        )
    size = dict(zip(left, a.shape, strict=True))
    for index, extent in zip(right, b.shape, strict=True):
        if size.setdefault(index, extent) != extent:
            raise ValueError(f"contract({spec!r}): index {index} is {size[index]} and {extent}")
    batch = [i for i in out if i in left and i in right]
    summed = [i for i in left if i in right and i not in out]
    left_free = [i for i in out if i in left and i not in right]
    right_free = [i for i in out if i in right and i not in left]

    def laid_out(t: torch.Tensor, names: str, *groups: list[str]) -> torch.Tensor:
        order = [names.index(i) for group in groups for i in group]
        return t.permute(order).reshape([math.prod([size[i] for i in g]) for g in groups])

    product = tf32_bmm(
        laid_out(a, left, batch, left_free, summed), laid_out(b, right, batch, summed, right_free)
    )
    names = batch + left_free + right_free
    product = product.reshape([size[i] for i in names])
    return product.permute([names.index(i) for i in out])

"""A linear layer's weight gradient added into megatron DDP's ``main_grad`` by one GEMM.

megatron-core's ``gradient_accumulation_fusion`` (``ModelParallelConfig``) makes its local linear
layers (``ColumnParallelLinear`` / ``RowParallelLinear``: ``LinearWithGradAccumulationAnd
AsyncCommunication.backward`` in megatron-core 0.19.2 ``tensor_parallel/layers.py``) add
``grad_output^T @ input`` straight into the weight's float32 ``main_grad``, set
``grad_added_to_main_grad`` and hand autograd a placeholder, through apex's
``fused_weight_gradient_mlp_cuda`` (``wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16``).
Without apex the flag cannot be set (``ColumnParallelLinear`` refuses it), so each linear
computes a bfloat16 weight gradient and megatron DDP's hook adds it into ``main_grad``: a
second kernel per weight and micro-batch that reads 2 and reads and writes 4 bytes per element
(at ``benchmarks/mfu.py``'s ``issue`` shape 64 adds, 2.3 ms of a profiled ``[*E]`` step on one
H200), and the weight gradient rounded to bfloat16 on the way.

:data:`WGRAD_KERNELS` computes the same with torch alone: ``torch.addmm`` with
``out_dtype=torch.float32`` and ``out=main_grad`` (torch >= 2.8 on CUDA: cuBLAS multiplies the
bfloat16 operands, accumulates in float32 and adds ``main_grad`` in its epilogue, one kernel,
no bfloat16 rounding of the gradient). Elsewhere (the CPU, which has no mixed-dtype GEMM) the
operands are cast to float32 first. :func:`install_wgrad_kernels` hands it to megatron's linear
layers where apex's extension is missing; ``train`` calls it (``training/fusions.py``): library
code does not patch megatron.
"""

from __future__ import annotations

import types

import torch

__all__ = ["WGRAD_KERNELS", "install_wgrad_kernels", "wgrad_kernels_reason"]

#: The apex extension's module name, as megatron-core imports it.
APEX_MODULE = "fused_weight_gradient_mlp_cuda"


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input`` into a float32 ``main_grad``, in place.

    Args:
        total_input: the layer's input, ``[tokens, in]`` (bfloat16, float16 or float32).
        grad_output: the gradient of its output, ``[tokens, out]``, the input's dtype.
        main_grad: ``[out, in]`` float32, contiguous (megatron DDP's buffer view).
    """
    if main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                    out=main_grad)  # fmt: skip
    else:  # no mixed-dtype GEMM off CUDA
        main_grad.addmm_(grad_output.t().float(), total_input.float())


def wgrad_gemm_accum_fp16(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input`` into a ``main_grad`` of the operands' dtype
    (megatron DDP without ``grad_reduce_in_fp32``)."""
    main_grad.addmm_(grad_output.t(), total_input)


#: Stands in for apex's ``fused_weight_gradient_mlp_cuda`` (its two functions, its arguments).
WGRAD_KERNELS = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16
)


def wgrad_kernels_reason() -> str | None:
    """Why megatron's local linears cannot fuse the weight-gradient add here, or None."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False):
        return None  # apex's extension, or these kernels already
    if "dtype_out" not in torch.ops.aten.addmm.overloads():
        return f"torch {torch.__version__} has no addmm with a float32 output (torch >= 2.8)"
    return None


def install_wgrad_kernels() -> str:
    """Give megatron-core's local linear layers :data:`WGRAD_KERNELS` where apex's
    ``fused_weight_gradient_mlp_cuda`` is not installed (idempotent).

    Returns:
        ``"apex"`` or ``"torch"``: which kernels the layers call.

    Raises:
        RuntimeError: :func:`wgrad_kernels_reason` says they cannot run here.
    """
    from megatron.core.tensor_parallel import layers

    if getattr(layers, APEX_MODULE, None) is WGRAD_KERNELS:
        return "torch"
    if getattr(layers, "_grad_accum_fusion_available", False):
        return "apex"
    reason = wgrad_kernels_reason()
    if reason is not None:
        raise RuntimeError(f"gradient_accumulation_fusion: {reason}")
    # megatron-core 0.19.2 reads both names from its module at call time.
    setattr(layers, APEX_MODULE, WGRAD_KERNELS)
    layers._grad_accum_fusion_available = True
    return "torch"

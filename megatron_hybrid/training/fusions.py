"""megatron-core's fused SwiGLU, cross-entropy and weight-gradient accumulation for ``train`` on
GPUs, where they compute what the unfused modules compute.

``TransformerConfig`` leaves them off. megatron-core 0.19.2 provides the first two without
TransformerEngine or apex, and the package the third (Megatron-LM turns it on by default):

* ``bias_activation_fusion``: the MLPs' and routed experts' SwiGLU through
  ``fusions/fused_bias_swiglu.py`` (``bias_swiglu_impl``, ``weighted_bias_swiglu_impl`` with the
  routing weight; ``@jit_fuser`` functions, ``torch.compile`` on GPUs) with a hand-written
  backward. It computes ``silu(a) * b`` and its exact derivative, but only for SwiGLU: with GELU
  it switches to the tanh approximation (``bias_gelu_impl``), another function, and it ignores the
  GLU's clamp and linear offset (``activation_func_clamp_value``, ``glu_linear_offset``);
* ``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl="native"``:
  ``fusions/fused_cross_entropy.py`` (``fused_vocab_parallel_cross_entropy``): the same steps as
  ``tensor_parallel.vocab_parallel_cross_entropy`` with one all-reduce instead of two and
  compiled kernels, except that its backward hands back the logits' gradient in bfloat16
  (``calculate_gradients``): exact for bf16 logits (the unfused gradient is cast to the logits'
  dtype too), a loss of precision for float32 or float16 ones. ``HybridModel`` runs it as one
  Triton pass over the logits each way where Triton imports
  (:mod:`~megatron_hybrid.kernels.cross_entropy`; ``MEGATRON_HYBRID_TRITON_CROSS_ENTROPY=0``
  keeps megatron's compiled functions);
* ``gradient_accumulation_fusion``: the local linear layers add their weight gradient into
  megatron DDP's float32 ``main_grad`` in the GEMM (``modules/fast/wgrad.py``, torch's
  ``addmm`` with a float32 output standing in for apex's ``fused_weight_gradient_mlp_cuda``)
  instead of a bfloat16 gradient that DDP's hook then adds: one kernel and one bfloat16 rounding
  fewer per weight and micro-batch. ``train`` always wraps its chunks in megatron's DDP, which
  the fused layers need (``main_grad``); ``--no-gradient-accumulation-fusion`` keeps it off.
  TransformerEngine's linears get the flag from megatron as ``fuse_wgrad_accumulation``; it is
  turned on here for the ``local`` layers only.

:func:`fusion_reasons` says which apply to a config and why the others do not;
:func:`apply_gpu_fusions` turns on those that apply (the ``train`` command and
``benchmarks/mfu.py`` call it on GPUs, before the model is built). On the CPU they stay off: the
compiled functions would run eagerly there, and CPU runs keep the unfused path's rounding.
"""

from __future__ import annotations

from megatron_hybrid.modules.fast.wgrad import install_wgrad_kernels, wgrad_kernels_reason

__all__ = ["WGRAD_FUSION_OFF", "apply_gpu_fusions", "fusion_reasons"]

#: The reason when the run turns the weight-gradient fusion off (Megatron-LM's flag).
WGRAD_FUSION_OFF = "--no-gradient-accumulation-fusion"


def _swiglu_reason(config) -> str | None:
    import torch.nn.functional as F  # noqa: N812 - torch's own name

    if config.activation_func is not F.silu or not config.gated_linear_unit:
        return "the activation is not SwiGLU (the fused GELU is the tanh approximation)"
    if getattr(config, "use_te_activation_func", False):
        return "TransformerEngine's activation module is used"
    if getattr(config, "activation_func_clamp_value", None) is not None:
        return "the GLU clamps its inputs (activation_func_clamp_value), which the fusion ignores"
    if getattr(config, "glu_linear_offset", 0.0):
        return "the GLU has a linear offset, which the fused SwiGLU ignores"
    return None


def _cross_entropy_reason(config) -> str | None:
    if not config.bf16:
        return "the logits are not bf16 (the fused backward returns bf16 gradients)"
    return None


def _wgrad_reason(config) -> str | None:
    if config.transformer_impl != "local":
        return (
            f"transformer_impl={config.transformer_impl!r}: TransformerEngine's linears take the "
            "flag as fuse_wgrad_accumulation, which train leaves as configured"
        )
    return wgrad_kernels_reason()


def fusion_reasons(config) -> dict[str, str | None]:
    """``{config field: None (it applies) or why not}`` for ``bias_activation_fusion``,
    ``cross_entropy_loss_fusion`` and ``gradient_accumulation_fusion``."""
    return {
        "bias_activation_fusion": _swiglu_reason(config),
        "cross_entropy_loss_fusion": _cross_entropy_reason(config),
        "gradient_accumulation_fusion": _wgrad_reason(config),
    }


def apply_gpu_fusions(
    config, *, gradient_accumulation_fusion: bool = True
) -> dict[str, str | None]:
    """Turn on each fusion of :func:`fusion_reasons` that applies to ``config`` (in place;
    the cross-entropy's ``native`` implementation, which needs no TransformerEngine; the
    weight-gradient kernels handed to megatron's linear layers where apex's are missing).

    The model must be built after this call (the linear layers read the flags then) and, with
    ``gradient_accumulation_fusion``, trained under megatron's DDP (the fused layers add into
    ``main_grad``).

    Args:
        config: a ``TransformerConfig``.
        gradient_accumulation_fusion: False: leave it off (:data:`WGRAD_FUSION_OFF`).

    Returns:
        :func:`fusion_reasons` of ``config`` (:data:`WGRAD_FUSION_OFF` where it was left off).
    """
    reasons = fusion_reasons(config)
    if not gradient_accumulation_fusion:
        reasons["gradient_accumulation_fusion"] = WGRAD_FUSION_OFF
    if reasons["bias_activation_fusion"] is None:
        config.bias_activation_fusion = True
    if reasons["cross_entropy_loss_fusion"] is None:
        config.cross_entropy_loss_fusion = True
        config.cross_entropy_fusion_impl = "native"
    if reasons["gradient_accumulation_fusion"] is None:
        install_wgrad_kernels()
        config.gradient_accumulation_fusion = True
    return reasons

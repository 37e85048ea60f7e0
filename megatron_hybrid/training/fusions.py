"""megatron-core's fused SwiGLU and cross-entropy for ``train`` on GPUs, where they compute what
the unfused modules compute.

``TransformerConfig`` leaves both off. megatron-core 0.19.2 provides them without
TransformerEngine or apex:

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
  dtype too), a loss of precision for float32 or float16 ones.

:func:`fusion_reasons` says which apply to a config and why the others do not;
:func:`apply_gpu_fusions` turns on those that apply (the ``train`` command and
``benchmarks/mfu.py`` call it on GPUs). On the CPU they stay off: the compiled functions would
run eagerly there, and CPU runs keep the unfused path's rounding.
"""

from __future__ import annotations

__all__ = ["apply_gpu_fusions", "fusion_reasons"]


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


def fusion_reasons(config) -> dict[str, str | None]:
    """``{config field: None (it applies) or why not}`` for ``bias_activation_fusion`` and
    ``cross_entropy_loss_fusion``."""
    return {
        "bias_activation_fusion": _swiglu_reason(config),
        "cross_entropy_loss_fusion": _cross_entropy_reason(config),
    }


def apply_gpu_fusions(config) -> dict[str, str | None]:
    """Turn on each fusion of :func:`fusion_reasons` that applies to ``config`` (in place;
    the cross-entropy's ``native`` implementation, which needs no TransformerEngine).

    Returns:
        :func:`fusion_reasons` of ``config``.
    """
    reasons = fusion_reasons(config)
    if reasons["bias_activation_fusion"] is None:
        config.bias_activation_fusion = True
    if reasons["cross_entropy_loss_fusion"] is None:
        config.cross_entropy_loss_fusion = True
        config.cross_entropy_fusion_impl = "native"
    return reasons

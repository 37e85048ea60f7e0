"""Layer norms for the ``local`` backend.

megatron-core's local norm without apex, ``WrappedTorchNorm``, refuses sequence parallelism. A
plain torch norm is correct under sequence parallelism as long as its parameters are marked
``sequence_parallel``: each TP rank then sees a slice of the sequence, and megatron's
``finalize_model_grads`` sums the norm's gradients over the TP group. :class:`TorchNorm` does
exactly that and keeps the parameter names (``weight``, ``bias``) and the initialisation of
``WrappedTorchNorm``, so checkpoints are interchangeable.

It also implements ``layernorm_zero_centered_gamma`` (``x_hat * (1 + w)``, ``w`` initialised to
zero), which megatron-core 0.19.2 has only in TransformerEngine's norms. Qwen3.5 and Qwen3-Next
store their norms this way; holding ``w`` as the checkpoint stores it (rather than folding
``1 + w`` into a plain gamma) keeps Hugging Face weights bitwise through a round trip and keeps
small ``w`` in bf16, where ``1 + w`` rounds them away.

:func:`plain_gamma_norm` makes a norm class that ignores ``layernorm_zero_centered_gamma``: the
gated output norm of GatedDeltaNet is a plain ``x_hat * w`` in fla and in transformers, whatever
the model's other norms are.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import functional

__all__ = ["TorchNorm", "ZeroCenteredRMSNorm", "local_norm_impl", "plain_gamma_norm"]


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gain: ``x / rms(x) * (1 + weight)``, computed in float32.

    The float32 computation and the order of operations are those of transformers'
    ``Qwen3NextRMSNorm`` (5.23), so a bf16 model gives the same activations as the reference
    (bit for bit on a CPU; on CUDA torch's fused kernel sums the squares in its own order).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm is transformers' x * rsqrt(mean(x^2) + eps) * gain (bit for bit on a
        # CPU); on CUDA it is one fused kernel where the written-out form is six, each launched
        # by the host (189 norms per forward_logprobs call of a Qwen3.5-MoE-shaped model).
        gain = 1.0 + self.weight.float()
        return functional.rms_norm(x.float(), gain.shape, gain, self.eps).type_as(x)


class _ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm with a zero-centred gain ``1 + weight`` (weight initialised to zero)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(
            x, self.normalized_shape, 1.0 + self.weight, self.bias, self.eps
        )


_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
_ZERO_CENTERED_NORMS = {"LayerNorm": _ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


class TorchNorm:
    """Build a ``torch.nn.LayerNorm``/``RMSNorm`` usable with or without sequence parallelism.

    Used like megatron's norm classes: ``TorchNorm(config=config, hidden_size=h, eps=eps)``.
    """

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs
    ) -> torch.nn.Module:
        # persist_layer_norm only selects apex's persistent kernel (Megatron-LM turns it on by
        # default); it does not change the math, so a torch norm can ignore it.
        if config.normalization not in _NORMS:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by the local backend's "
                f"torch norm; choose one of {sorted(_NORMS)} or use the 'te' backend."
            )
        if getattr(config, "layernorm_zero_centered_gamma", False):
            norm = _ZERO_CENTERED_NORMS[config.normalization](hidden_size, eps=eps)
        else:
            norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            # Read by finalize_model_grads: the grads of SP-replicated params are summed over TP.
            param.sequence_parallel = config.sequence_parallel
        return norm


def local_norm_impl() -> type:
    """The norm GPTModel's local spec uses, with ``WrappedTorchNorm`` replaced by TorchNorm.

    With apex installed this is apex's ``FusedLayerNorm`` (SP-capable already), as in
    megatron-core; without it, :class:`TorchNorm`.
    """
    from megatron.core.models.backends import LNImpl
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return TorchNorm if LNImpl is WrappedTorchNorm else LNImpl


def plain_gamma_norm(base: type) -> type:
    """A norm class like ``base`` that never applies ``layernorm_zero_centered_gamma``."""

    class PlainGammaNorm:
        def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            if getattr(config, "layernorm_zero_centered_gamma", False):
                config = dataclasses.replace(config, layernorm_zero_centered_gamma=False)
            return base(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    PlainGammaNorm.__name__ = PlainGammaNorm.__qualname__ = f"PlainGamma{base.__name__}"
    return PlainGammaNorm

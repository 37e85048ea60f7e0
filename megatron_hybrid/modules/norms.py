"""Layer norms for the ``local`` backend.

megatron-core's local norm without apex, ``WrappedTorchNorm``, refuses sequence parallelism. A
plain torch norm is correct under sequence parallelism as long as its parameters are marked
``sequence_parallel``: each TP rank then sees a slice of the sequence, and megatron's
``finalize_model_grads`` sums the norm's gradients over the TP group. :class:`TorchNorm` does
exactly that and keeps the parameter names (``weight``, ``bias``) and the initialisation of
``WrappedTorchNorm``, so checkpoints are interchangeable.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TorchNorm", "local_norm_impl"]


_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class TorchNorm:
    """Build a ``torch.nn.LayerNorm``/``RMSNorm`` usable with or without sequence parallelism.

    Used like megatron's norm classes: ``TorchNorm(config=config, hidden_size=h, eps=eps)``.
    """

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs
    ) -> torch.nn.Module:
        # persist_layer_norm only selects apex's persistent kernel (Megatron-LM turns it on by
        # default); it does not change the math, so a torch norm can ignore it.
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError(
                "TransformerConfig sets layernorm_zero_centered_gamma, which torch norms do not "
                "implement; use the 'te' backend or turn it off"
            )
        if config.normalization not in _NORMS:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by the local backend's "
                f"torch norm; choose one of {sorted(_NORMS)} or use the 'te' backend."
            )
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

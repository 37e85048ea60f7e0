"""Routed experts as one grouped GEMM per expert linear (``torch._grouped_mm``).

megatron-core 0.19.2's local experts (``SequentialMLP``) copy the tokens-per-expert counts to
the host (``.tolist()``), split the permuted tokens and run each expert's MLP one after another:
with 64 experts that is 64 small GEMMs per linear, each with its own activation kernels, and a
host synchronisation per layer. :class:`GroupedGemmExperts` computes the same function with
one grouped GEMM per linear over all local experts: the tokens arrive sorted by expert (the
dispatcher's permutation), the device-side cumulative counts are the group offsets, and nothing
waits for the host.

It *is* a ``SequentialMLP``: the same submodules (``local_experts.{e}.linear_fc1/fc2``), the
same parameters, state dict and sharded state dict (megatron's expert-axis keys, identical to
``TEGroupedMLP``'s), so checkpoints, the distributed optimizer, Hugging Face conversion and
anything that walks the experts by name see no difference. Each linear's local expert weights
are built into one storage (``[E, out, in]``, each expert's parameter a view of its row), which
the grouped GEMM multiplies in place. megatron's DDP moves them into its buffer, in expert
order where ``train`` builds it (``training/param_order.py``); where something has moved them
apart (megatron's own buffer order), each call stacks them (one copy kernel per linear). The
backward computes the input gradient and all experts' weight gradients with one grouped GEMM
each and adds the weight gradients with one kernel per linear, into megatron DDP's
``main_grad`` or into one stacked ``.grad`` (:mod:`~megatron_hybrid.modules.fast.grouped_linear`).

The seam for adapters: every expert linear goes through :meth:`GroupedGemmExperts.grouped_linear`
``(name, tokens, offsets)``. A LoRA implementation that wraps ``local_experts.{e}.linear_fc1``
is detected (the linears are no longer plain) and the reference loop runs; to stay on the grouped
path, override or wrap ``grouped_linear`` and add ``B_e A_e x`` for each group (the same
``offsets`` select each expert's rows).
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP
from torch.nn import functional

from megatron_hybrid.modules.fast.grouped_linear import grouped_linear, pack_weights
from megatron_hybrid.modules.fast.selection import grouped_gemm_reason

__all__ = ["GroupedGemmExperts", "expert_activation", "group_offsets"]


def group_offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """End offset of each expert's rows (``int32``, on ``device``), computed on the device."""
    counts = tokens_per_expert.to(device=device, non_blocking=True)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def expert_activation(config, activation_func, hidden: torch.Tensor, probs: torch.Tensor):
    """The activation of megatron's expert ``MLP.forward`` with its per-token routing weight.

    The same branches as ``MLP.forward`` (megatron-core 0.19.2) takes with ``per_token_scale``
    and without biases or TransformerEngine's activation module: the fused weighted SwiGLU /
    quick-GeGLU where ``bias_activation_fusion`` is on, else the GLU (with the clamp and the
    linear offset) or the plain activation, then the weight in the activation's dtype.
    """
    if config.bias_activation_fusion:
        weights = probs.unsqueeze(-1)
        if activation_func == functional.silu and config.gated_linear_unit:
            return weighted_bias_swiglu_impl(
                hidden, None, weights, config.activation_func_fp8_input_store
            )
        if activation_func == quick_gelu and config.gated_linear_unit:
            return weighted_bias_quick_geglu_impl(
                hidden, None, weights, config.activation_func_fp8_input_store,
                config.glu_linear_offset, config.activation_func_clamp_value,
            )  # fmt: skip
        raise ValueError(
            "Only support fusion of swiglu and quick_gelu with per_token_scale in MLP."
        )
    if config.gated_linear_unit:
        gate, linear = torch.chunk(hidden, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        hidden = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        hidden = activation_func(hidden)
    dtype = hidden.dtype
    return (hidden * probs.unsqueeze(-1)).to(dtype)


class GroupedGemmExperts(SequentialMLP):
    """megatron-core's ``SequentialMLP`` with its expert loop replaced by grouped GEMMs.

    Constructor, parameters and checkpoints are ``SequentialMLP``'s. ``forward`` runs the
    grouped path where :func:`~megatron_hybrid.modules.fast.selection.grouped_gemm_reason`
    allows it and ``SequentialMLP.forward`` otherwise (``fast_path_reason`` says why).
    """

    fast_path_reason: str | None = "not run"
    #: The grouped path reads ``tokens_per_expert`` on the device only (no ``.tolist()``), so
    #: with a dispatcher that keeps them there its inputs have fixed shapes and CUDA graphs may
    #: capture it (``modules/layer_types/moe.py``).
    takes_device_counts = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each linear's expert weights in one storage: the grouped GEMM multiplies them where
        # they lie instead of stacking a copy on every call (grouped_linear.pack_weights).
        for name in ("linear_fc1", "linear_fc2"):
            pack_weights(self.expert_weights(name))

    def expert_weights(self, name: str) -> list[torch.Tensor]:
        """Every local expert's weight of linear ``name``, in expert order.

        Read from the submodules' own dictionaries: ``getattr`` goes through ``nn.Module``'s
        ``__getattr__`` twice per expert, about 3 microseconds each on the host, which for a
        layer of 256 experts was 1.7 ms of every forward (one H200, 2026-11-28). A linear
        whose weight is not a registered parameter of that name falls back to ``getattr``.
        """
        try:
            return [e._modules[name]._parameters["weight"] for e in self.local_experts]
        except KeyError:
            return [getattr(e, name).weight for e in self.local_experts]

    def grouped_linear(
        self, name: str, tokens: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """``tokens[rows of e] @ W_e^T`` for every local expert ``e`` of linear ``name``.

        Args:
            name: ``"linear_fc1"`` or ``"linear_fc2"``.
            tokens: ``[rows, in]``, sorted by expert.
            offsets: ``[E]`` int32 end offsets of each expert's rows (:func:`group_offsets`).

        Returns:
            ``[rows, out]``. This is the seam adapters hook (see the module docstring).
        """
        return grouped_linear(tokens, offsets, self.expert_weights(name))

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """``(output, None)`` for tokens sorted by local expert (``SequentialMLP``'s contract)."""
        hidden = permuted_local_hidden_states
        reason = grouped_gemm_reason(self, hidden) if hidden.shape[0] else "no routed tokens"
        self.fast_path_reason = reason
        if reason is not None:
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        config = self.config
        if config.moe_apply_probs_on_input:
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        offsets = group_offsets(tokens_per_expert, hidden.device)
        intermediate = self.grouped_linear("linear_fc1", hidden, offsets)
        activation_func = self.local_experts[0].activation_func
        intermediate = expert_activation(config, activation_func, intermediate, permuted_probs)
        return self.grouped_linear("linear_fc2", intermediate, offsets), None

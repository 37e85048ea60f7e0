"""One linear's adapter: ``y = W x + scale * B A x`` under tensor, sequence and expert
parallelism.

The adapter lives inside the linear it adapts (``<linear>.lora``) and runs as a forward hook,
so the base keeps its module path, parameter names and checkpoint keys. ``B`` has the base
weight's rows, in the base weight's local order, so it shards exactly as the weight does; a
fused weight (``linear_qkv``, ``linear_fc1``, GatedDeltaNet's ``in_proj``) holds several Hugging
Face *pieces*, each with its own ``A`` block: row ``i`` of ``B`` multiplies ``A`` block
``piece[i]`` (a fixed one-hot map, zero for rows of pieces that have no adapter).

Parallel math (``x`` the layer's input, ``h = A x`` of width ``pieces * r``):

* column-parallel (``A`` replicated, ``B`` row-sharded like the weight): without sequence
  parallelism ``h`` enters a copy-to-TP region (its gradient is summed over TP, so ``A``'s
  gradient and the input gradient are complete on every rank); with it, ``h`` is computed on
  the local tokens and all-gathered along the sequence (``A``'s gradient is then a partial sum
  over sequence shards, reduced by ``finalize_model_grads`` as for layer norms).
* row-parallel (``A`` column-sharded like the weight, ``B`` replicated): the rank-``r``
  partial sums ``A_t x_t`` are all-reduced (reduce-scattered along the sequence with sequence
  parallelism) before ``B``.
* experts whose TP communication the dispatcher does (``explicit_expert_comm``, expert-TP > 1):
  the layer's output stays a partial sum that the dispatcher reduces, so the adapter adds its
  own partial sum; ``A`` (column) or ``B`` (row) then has a partial gradient, all-reduced over
  expert-TP in the backward pass. Exact, unlike adapters that add a full output per rank
  (Megatron-Bridge #5635).
"""

from __future__ import annotations

import torch

from megatron_hybrid.peft.linears import LinearInfo

__all__ = ["LoRAAdapter", "lora_grouped_linear", "lora_hook"]


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient is all-reduced over ``group`` (for a parameter used
    with a partial input on each rank of the group)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _dropout(x: torch.Tensor, p: float, sharded: bool) -> torch.Tensor:
    if sharded:  # different tokens or columns per TP rank: the model-parallel RNG
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x, p, True)
    return torch.nn.functional.dropout(x, p, True)


class LoRAAdapter(torch.nn.Module):
    """Low-rank adapters of one linear (one pair per local weight: grouped layers hold one
    weight per local expert).

    Not part of the model's ``state_dict``/``sharded_state_dict``: those stay the base's (HF
    conversion, base checkpoints and GPT keys are unchanged); adapter state goes through
    :mod:`megatron_hybrid.peft.checkpoint` and the PEFT functions.

    Args:
        info: the linear's :class:`LinearInfo`.
        rank: ``r``.
        scale: ``alpha / r`` (or rsLoRA's).
        dropout: input dropout while training.
        blocks: number of ``A`` blocks (pieces with their own ``A``; 1 for ``shared_a``).
        onehot: ``[out_local, blocks]`` float map of each local row to its ``A`` block (all
            zero for rows without an adapter), or None when ``blocks == 1`` and every row has
            one.
        in_features: local input width of each weight.
    """

    def __init__(
        self,
        info: LinearInfo,
        *,
        rank: int,
        scale: float,
        dropout: float,
        blocks: int,
        onehot: torch.Tensor | None,
        in_features: int,
    ) -> None:
        super().__init__()
        self.info = info
        self.rank, self.scale, self.dropout, self.blocks = rank, scale, dropout, blocks
        self.enabled = True
        weight = info.weights[0]
        out = weight.shape[0]
        kwargs = dict(dtype=weight.dtype, device=weight.device)
        self.pairs = len(info.weights)
        for i in range(self.pairs):
            suffix = "" if self.pairs == 1 else str(i)
            a = torch.nn.Parameter(torch.empty(blocks * rank, in_features, **kwargs))
            b = torch.nn.Parameter(torch.zeros(out, rank, **kwargs))
            self.register_parameter(f"lora_A{suffix}", a)
            self.register_parameter(f"lora_B{suffix}", b)
        self.register_buffer(
            "onehot", None if onehot is None else onehot.to(**kwargs), persistent=False
        )
        self._mark_parameters()

    # --- parameters -----------------------------------------------------------------------

    def a(self, i: int = 0) -> torch.nn.Parameter:
        return getattr(self, "lora_A" if self.pairs == 1 else f"lora_A{i}")

    def b(self, i: int = 0) -> torch.nn.Parameter:
        return getattr(self, "lora_B" if self.pairs == 1 else f"lora_B{i}")

    def _mark_parameters(self) -> None:
        """The attributes megatron's DDP, gradient finalisation and norm read."""
        info = self.info
        split = {"column": ("b", 0), "row": ("a", 1)}.get(info.mode)
        # Gradients that are partial sums over sequence shards, summed over TP by
        # finalize_model_grads as it sums layer-norm gradients.
        partial = {"column": ("a",), "row": ("b",), "duplicated": ("a", "b")}[info.mode]
        for i in range(self.pairs):
            for name, param in (("a", self.a(i)), ("b", self.b(i))):
                sharded = split is not None and split[0] == name and info.tp_size > 1
                param.tensor_model_parallel = sharded
                param.partition_dim = split[1] if sharded else -1
                param.partition_stride = 1
                # Expert gradients are reduced over expert data parallelism only.
                param.allreduce = not info.is_expert
                if info.sequence_parallel and name in partial:
                    param.sequence_parallel = True

    # --- math -----------------------------------------------------------------------------

    def b_full(self, i: int = 0) -> torch.Tensor:
        """``[out_local, blocks * r]``: ``B`` with each row placed at its piece's ``A`` block."""
        b = self.b(i)
        if self.onehot is None:
            return b
        return (b.unsqueeze(1) * self.onehot.unsqueeze(-1)).reshape(b.shape[0], -1)

    @torch.no_grad()
    def delta(self, i: int = 0) -> torch.Tensor:
        """``scale * B A`` of this rank's shard, float32, shaped like the weight."""
        return self.scale * (self.b_full(i).float() @ self.a(i).float())

    def _project(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The adapter's output for input ``x`` of weight ``i`` (same parallel layout as the
        base layer's output)."""
        from megatron.core.tensor_parallel import mappings

        info = self.info
        group = info.tp_group
        a, b = self.a(i), self.b_full(i)
        if info.mode == "row":
            if not info.input_is_parallel and info.tp_size > 1:
                x = mappings.scatter_to_tensor_model_parallel_region(x, group=group)
            h = x @ a.t()
            if info.explicit_comm and info.tp_size > 1:
                return h @ _AllReduceGrad.apply(b, group).t()
            if info.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
            elif info.tp_size > 1:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
            return h @ b.t()
        if info.mode == "column" and info.tp_size > 1:
            if info.explicit_comm:
                return (x @ _AllReduceGrad.apply(a, group).t()) @ b.t()
            h = x @ a.t()
            if info.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
            y = h @ b.t()
            if info.gather_output:
                y = mappings.gather_from_tensor_model_parallel_region(y, group=group)
            return y
        return (x @ a.t()) @ b.t()

    def grouped_factors(self, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of weight ``i`` as a grouped GEMM over experts uses them: the expert-TP
        gradient reductions of :meth:`_project` included (expert linears see neither sequence
        parallelism nor their own TP communication)."""
        info = self.info
        a, b = self.a(i), self.b_full(i)
        if info.explicit_comm and info.tp_size > 1:
            if info.mode == "column":
                a = _AllReduceGrad.apply(a, info.tp_group)
            else:
                b = _AllReduceGrad.apply(b, info.tp_group)
        return a, b

    def forward(self, x: torch.Tensor, m_splits=None) -> torch.Tensor:
        """``scale * B A x`` (per expert for grouped layers, ``m_splits`` tokens each)."""
        info = self.info
        if info.input_norm is not None:
            x = info.input_norm(x)
        if self.dropout and self.training:
            sharded = info.mode == "row" or info.sequence_parallel
            x = _dropout(x, self.dropout, sharded)
        if self.pairs == 1:
            return self.scale * self._project(x, 0)
        parts = torch.split(x, [int(size) for size in m_splits])
        return self.scale * torch.cat([self._project(p, i) for i, p in enumerate(parts)])

    # --- state dict: adapters are not part of the base's --------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *args):
        present = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        if present:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing, *args
            )


def lora_grouped_linear(experts: torch.nn.Module, original):
    """``experts.grouped_linear`` with the experts' adapters added.

    Grouped-GEMM experts (``modules/fast/experts.py``: ``GroupedGemmExperts``) compute every
    local expert's linear in one ``torch._grouped_mm`` over the stacked weights, without calling
    the expert linears, whose hooks then never run. This wrapper of that seam adds
    ``scale * B_e A_e x`` for each expert's rows with two grouped GEMMs of its own (the same
    ``offsets``). Targets may adapt some local experts and not others (a module-path target
    such as ``*.local_experts.0.linear_fc1``) or give them different ``A`` widths (different
    pieces): each expert's factors are padded with zeros to one width, an expert without an
    (enabled) adapter gets zero factors, so its rows get nothing added.
    """

    def grouped_linear(name: str, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = original(name, tokens, offsets)
        linears = [getattr(expert, name) for expert in experts.local_experts]
        found = [getattr(linear, "lora", None) for linear in linears]
        present = [a for a in found if a is not None and a.enabled]
        if not present:
            return out
        # One LoRAConfig: the same scale and dropout for every adapter.
        adapter = present[0]
        x = tokens
        if adapter.dropout and adapter.training:
            x = _dropout(x, adapter.dropout, sharded=False)
        factors = [a.grouped_factors() if a in present else None for a in found]
        width = max(f[0].shape[0] for f in factors if f is not None)
        # The grouped GEMM wants 16-byte strides: zero rows of A and columns of B pad the rank
        # (their products are zero).
        width += -width % (16 // x.element_size())
        a_rows, b_cols = [], []
        for factor in factors:
            if factor is None:
                a_rows.append(x.new_zeros(width, x.shape[1]))
                b_cols.append(x.new_zeros(out.shape[1], width))
                continue
            a, b = factor
            pad = width - a.shape[0]
            a_rows.append(torch.nn.functional.pad(a.to(x.dtype), (0, 0, 0, pad)))
            b_cols.append(torch.nn.functional.pad(b.to(x.dtype), (0, pad)))
        a, b = torch.stack(a_rows), torch.stack(b_cols)
        h = torch._grouped_mm(x, a.transpose(1, 2), offs=offsets)
        y = torch._grouped_mm(h, b.transpose(1, 2), offs=offsets)
        return out + adapter.scale * y.to(out.dtype)

    return grouped_linear


def lora_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook of an adapted linear: adds the adapter's output to the layer's."""
    adapter: LoRAAdapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else next(iter(kwargs.values()))
    m_splits = None
    if adapter.info.grouped:
        m_splits = args[1] if len(args) > 1 else kwargs.get("m_splits")
    y = adapter(x, m_splits)
    base = output[0] if isinstance(output, tuple) else output
    if y.shape != base.shape:
        info = adapter.info
        raise RuntimeError(
            f"LoRA on a {type(module).__name__}: the adapter's output {tuple(y.shape)} does not "
            f"match the layer's {tuple(base.shape)} (input {tuple(x.shape)}); the adapter "
            f"read the layer as mode={info.mode!r}, sequence_parallel={info.sequence_parallel}, "
            f"tp_size={info.tp_size}, explicit_comm={info.explicit_comm}, whose communication "
            "differs from the layer's own (peft/linears.py describes each linear class)"
        )
    if isinstance(output, tuple):
        return (base + y.to(base.dtype), *output[1:])
    return base + y.to(base.dtype)

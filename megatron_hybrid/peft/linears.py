"""The linear layers LoRA attaches to, and how each one is parallel (a registry by class).

megatron-core 0.19.2 builds its linears from a few classes: ``ColumnParallelLinear`` /
``RowParallelLinear`` (``tensor_parallel/layers.py``, the ``local`` spec and ``SequentialMLP``'s
experts) and TransformerEngine's wrappers (``extensions/transformer_engine.py``:
``TEColumnParallelLinear``, ``TERowParallelLinear``, ``TELinear`` in ``duplicated`` mode,
``TELayerNormColumnParallelLinear`` with the input norm fused in, and the grouped-GEMM experts'
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``). For each,
:func:`linear_info` says what the adapter needs: the parallel mode, the TP group, whether the
input is sequence-parallel, whether the expert dispatcher does the TP communication instead of
the layer (``explicit_expert_comm``), the weights (one per local expert for grouped layers) and
a fused input norm to reproduce. :func:`register_linear` adds another class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["LinearInfo", "linear_info", "register_linear"]


@dataclass(frozen=True)
class LinearInfo:
    """What an adapter needs to know about the linear it wraps.

    Attributes:
        mode: ``"column"`` (output rows sharded over TP), ``"row"`` (input columns sharded)
            or ``"duplicated"`` (replicated over TP).
        weights: the local weights ``[out_local, in_local]``: one, or one per local expert.
        tp_group: the layer's tensor-parallel group (expert-TP for experts).
        sequence_parallel: the layer gathers its input (column) or reduce-scatters its output
            (row) along the sequence; for ``duplicated``, its input is sequence-sharded.
        explicit_comm: an expert layer whose TP communication the token dispatcher does (the
            layer neither gathers nor reduces; row outputs are partial sums).
        is_expert: a routed-expert layer (gradients reduced over expert data parallelism).
        gather_output: a column layer that all-gathers its output.
        input_is_parallel: a row layer whose input is already split over TP.
        input_norm: ``x -> norm(x)`` for layers with a fused input norm (the adapter sees what
            the GEMM sees), else None.
        grouped: a grouped-GEMM layer called as ``forward(x, m_splits)``.
    """

    mode: str
    weights: tuple[torch.nn.Parameter, ...]
    tp_group: object
    sequence_parallel: bool
    explicit_comm: bool
    is_expert: bool
    gather_output: bool = False
    input_is_parallel: bool = True
    input_norm: Callable | None = None
    grouped: bool = False

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else self.tp_group.size()

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp_group is None else self.tp_group.rank()


#: class -> ``module -> LinearInfo``.
_REGISTRY: dict[type, Callable[[torch.nn.Module], LinearInfo]] = {}


def register_linear(cls: type, describe: Callable[[torch.nn.Module], LinearInfo]) -> None:
    """Let LoRA wrap ``cls`` (for example a new grouped-GEMM expert linear).

    ``describe(module)`` returns its :class:`LinearInfo`. The module's forward must take the
    input as its first argument (and ``m_splits`` second for grouped layers) and return
    ``(output, bias)``.
    """
    _REGISTRY[cls] = describe


def _megatron(mode: str):
    def describe(m) -> LinearInfo:
        return LinearInfo(
            mode=mode,
            weights=(m.weight,),
            tp_group=m.tp_group,
            sequence_parallel=bool(m.sequence_parallel) and not m.explicit_expert_comm,
            explicit_comm=bool(m.explicit_expert_comm),
            is_expert=bool(m.is_expert),
            gather_output=bool(getattr(m, "gather_output", False)),
            input_is_parallel=bool(getattr(m, "input_is_parallel", True)),
        )

    return describe


def _register_megatron() -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    register_linear(ColumnParallelLinear, _megatron("column"))
    register_linear(RowParallelLinear, _megatron("row"))


def _te_norm(m) -> Callable:
    """TransformerEngine's fused input norm of a ``LayerNormLinear`` (computed in float32, as
    TE's kernels do), so that the adapter sees the normalised input."""

    def norm(x: torch.Tensor) -> torch.Tensor:
        weight = m.layer_norm_weight.float()
        if getattr(m, "zero_centered_gamma", False):
            weight = weight + 1
        xf = x.float()
        if m.normalization == "RMSNorm":
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m.eps) * weight
        else:
            bias = getattr(m, "layer_norm_bias", None)
            out = torch.nn.functional.layer_norm(
                xf, (xf.shape[-1],), weight, None if bias is None else bias.float(), m.eps
            )
        return out.to(x.dtype)

    return norm


def _te(mode: str | None, *, norm: bool = False, grouped: bool = False):
    def describe(m) -> LinearInfo:
        weights = (
            tuple(getattr(m, f"weight{i}") for i in range(m.num_gemms)) if grouped else (m.weight,)
        )
        # Reduced over expert data parallelism: megatron-core 0.19.2 sets ``allreduce=False`` on
        # expert weights only where EP > 1 or expert-TP != TP (``_set_expert_parameter_attributes``
        # in extensions/transformer_engine.py), so this does not say whether a layer is an expert.
        is_expert = not getattr(weights[0], "allreduce", True)
        group = m._tp_group
        size = group.size() if group is not None else 1
        explicit = getattr(m, "explicit_expert_comm", None)
        if explicit is None:
            # megatron-core 0.19.2 keeps ``explicit_expert_comm`` on its grouped TE linears only.
            # A plain TE linear of an expert whose TP communication megatron does itself
            # (SequentialMLP's experts at expert-TP or EP > 1) is handed to TE with
            # ``parallel_mode=None`` (``TELinear.__init__``), where every other column or row
            # layer keeps its mode: TE's own mode is the truth of what the layer communicates.
            explicit = mode is not None and getattr(m, "parallel_mode", mode) is None
        layer_mode = mode or "duplicated"
        if layer_mode == "duplicated":
            # No TP group of its own, but its input is sequence-sharded under sequence
            # parallelism (MLA's down-projections): megatron-core 0.19.2 marks the weight
            # sequence_parallel for that (transformer_engine.py: TELinear.__init__), and the
            # adapter's gradients are partial sums over sequence shards alike.
            sequence_parallel = bool(m.config.sequence_parallel)
        else:
            sequence_parallel = bool(m.config.sequence_parallel) and size > 1 and not explicit
        return LinearInfo(
            mode=layer_mode,
            weights=weights,
            tp_group=group,
            sequence_parallel=sequence_parallel,
            explicit_comm=bool(explicit),
            is_expert=is_expert,
            input_norm=_te_norm(m) if norm else None,
            grouped=grouped,
        )

    return describe


def _register_te() -> None:
    try:
        from megatron.core.extensions import transformer_engine as te
    except ImportError:  # TransformerEngine absent: only the local classes exist
        return
    if not getattr(te, "HAVE_TE", True):
        return
    register_linear(te.TELinear, _te(None))
    register_linear(te.TEColumnParallelLinear, _te("column"))
    register_linear(te.TERowParallelLinear, _te("row"))
    register_linear(te.TELayerNormColumnParallelLinear, _te("column", norm=True))
    for name, mode in (
        ("TEColumnParallelGroupedLinear", "column"),
        ("TERowParallelGroupedLinear", "row"),
    ):
        cls = getattr(te, name, None)
        if cls is not None:
            register_linear(cls, _te(mode, grouped=True))


_LOADED = False


def linear_info(module: torch.nn.Module) -> LinearInfo | None:
    """The module's :class:`LinearInfo`, or None if LoRA does not know its class."""
    global _LOADED
    if not _LOADED:
        _register_megatron()
        _register_te()
        _LOADED = True
    describe = _REGISTRY.get(type(module))
    return None if describe is None else describe(module)

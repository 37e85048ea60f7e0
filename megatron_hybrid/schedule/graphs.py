"""CUDA graphs for the compute pieces of a HybridModel, in both schedules.

A *piece* is a submodule that each layer type names in its runtime record
(:attr:`~megatron_hybrid.modules.registry.LayerRuntime.graph_pieces`): the token mixer of
``*``/``G``/``M`` layers, the MLP of ``-``, the router and shared experts of ``E``. Pieces with a
reason (dispatch preprocessing, all-to-all, routed experts, or a setting that cannot be
captured) stay eager, and the reason is reported. :func:`enable_cuda_graphs` replaces the forward
of every capturable piece by a :class:`GraphedForward`. The plain schedule
(``HybridStack.forward``) and the EP-overlap plan's slot callables
(:mod:`megatron_hybrid.schedule.callables`) call the same submodules, so both replay the same
graphs, forward and backward.

A :class:`GraphedForward` captures its piece with ``torch.cuda.make_graphed_callables`` (warm-up on
a side stream, then one forward and one backward graph, with the parameters as the graphs' extra
inputs so that their gradients reach autograd) once per input signature (shapes, dtypes,
``requires_grad``, the non-tensor arguments). A graph's activations live in its memory pool until
its backward has run, and the combined-1F1B schedule keeps several micro-batches in flight, so
each signature has a small set of graph instances: a forward takes a free one (capturing another
when all are busy) and the backward gives it back.

Gradients, as megatron-core 0.19.2 treats them (``transformer/cuda_graphs.py``):
* the warm-up backward runs on dummy output gradients, so every parameter's ``main_grad`` and
  ``grad`` and the piece's buffers are restored after capture (megatron-core backs them up
  before capture likewise);
* a local linear with ``gradient_accumulation_fusion`` adds its weight gradient to ``main_grad``
  inside its backward and sets ``grad_added_to_main_grad`` in Python; the add is captured, the
  Python flag is not replayed, so it is set again on every replayed backward (megatron-core sets
  it in its graphed backward) and megatron's DDP hook does not add the dummy gradient again;
* the replayed backward hands autograd the parameter gradients in the graph's static memory,
  and autograd may keep such a tensor as ``.grad`` (it steals gradients nobody else references),
  so the next replay would overwrite an accumulated gradient: a hook on each graphed parameter
  gives autograd a copy (megatron-core adds into ``main_grad`` inside the graph instead, which
  needs megatron's DDP; this works with and without it). A parameter whose captured backward
  added its gradient to ``main_grad`` (its flag is set again before the graphed backward runs)
  hands DDP only a placeholder, which DDP's hook drops: it is not copied;
* TransformerEngine linears with ``delay_wgrad_compute`` queue their weight gradient in Python,
  which a replay does not run: those pieces stay eager (megatron-core captures a separate wgrad
  graph instead).

Packed (THD) micro-batches: a piece that reads their boundaries on the device only
(``GraphPiece.packed``: the fast attention and MLA, whose varlen FlashAttention and RoPE take
them as tensors; GatedDeltaNet on fla's kernels, with a chunk table built on the device; the
torch Mamba mixer, with ``seq_idx`` made on the device) gets them as
:class:`~megatron_hybrid.padding.fixed.FixedPackedSeqParams`, boundaries padded with empty
sequences to a power-of-two capacity and ``max_seqlen`` the row's length plus one, so every
micro-batch of one row length and capacity replays one graph whatever its sequences; the two
boundary tensors are graph inputs like the hidden states. Other pieces run such calls eager
(:data:`PACKED_REASON`). Whether the device-only path runs is decided per call (dtype,
settings); where it does not, the capture fails on its host read, and packed calls of that piece
run eager from then on, with the failure as their reason, while its other calls still replay.

Calls that cannot replay a graph run the original forward, with the reason kept in
:attr:`GraphedForward.eager_calls`: inference or ``torch.no_grad`` (no backward would free the
graph), an argument that is neither a tensor nor a plain scalar (``inference_context``), packed
boundaries a piece reads on the host, inputs not on a CUDA device, a new input shape once a
piece has graphs for :data:`MAX_SIGNATURES` shapes (variable-length micro-batches), and a
capture that failed (a host sync or an operation that capture forbids; the piece then stays
eager for good, which is logged once with the operation that failed, and the process is as it
was before the capture: :mod:`~megatron_hybrid.schedule.graph_capture`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from megatron_hybrid.modules.registry import layer_runtime
from megatron_hybrid.padding.fixed import fixed_capacity_params
from megatron_hybrid.schedule.graph_capture import (
    GraphCaptureError,
    capture_cuda_graph,
    use_side_stream,
)

__all__ = [
    "MAX_SIGNATURES",
    "PACKED_REASON",
    "CudaGraphReport",
    "GraphCaptureError",
    "GraphedForward",
    "capture_cuda_graph",
    "check_cuda_graph_config",
    "disable_cuda_graphs",
    "enable_cuda_graphs",
    "graphs_digest",
]

logger = logging.getLogger(__name__)

#: ``(piece, sample_args) -> graphed piece``: called with tensors, returns a tuple of tensors.
CaptureFunction = Callable[[nn.Module, tuple[Tensor, ...]], Callable[..., tuple[Tensor, ...]]]

#: Graph instances per signature before calls run eager: the schedules keep at most a few
#: micro-batches in flight per layer; more means backward never frees them.
MAX_INSTANCES = 8
#: Input signatures (shapes) a piece captures before calls with a new one run eager. Every
#: capture costs warm-up iterations and a private memory pool that lives as long as the graph:
#: micro-batches of ever new lengths (padded variable-length data) would capture on almost every
#: call and hold a pool per length. Fixed-size micro-batches (one token budget per micro-batch)
#: have one signature.
MAX_SIGNATURES = 4
_SCALARS = (type(None), bool, int, float, str, Enum, torch.dtype)


def check_cuda_graph_config(config) -> None:
    """Raise if ``config`` has a setting that the package's CUDA graphs cannot capture.

    Raises:
        ValueError: what is set and what to change.
    """
    problems = []
    if config.cuda_graph_impl != "none":
        problems.append(
            f"cuda_graph_impl={config.cuda_graph_impl!r} turns on megatron-core's own graphs; "
            "set it to 'none' (hybrid_cuda_graphs replaces them for HybridModel)"
        )
    if config.recompute_granularity is not None:
        problems.append(
            f"recompute_granularity={config.recompute_granularity!r} re-runs forwards inside "
            "backward, which a captured piece cannot replay; set it to None"
        )
    if config.fp8 or config.fp4:
        problems.append(
            "FP8/FP4 scaling state is updated outside a captured graph; turn fp8/fp4 off or use "
            "megatron-core's cuda_graph_impl='transformer_engine' with GPTModel"
        )
    if problems:
        raise ValueError("hybrid CUDA graphs: " + "; ".join(problems))


class _Piece(nn.Module):
    """The original forward of a submodule as a function of its tensor arguments only.

    ``make_graphed_callables`` takes a module with tensor inputs and outputs and captures its
    parameters (the submodule's, registered here as a child) as extra graph inputs.
    """

    def __init__(self, target: nn.Module, forward: Callable, rebuild: Callable):
        super().__init__()
        self.target = target
        self._forward, self._rebuild = forward, rebuild
        self.out_spec = None
        self.constants: dict[int, object] = {}
        self.fused_params: list[Tensor] = []

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        args, kwargs = self._rebuild(tensors)
        leaves, self.out_spec = tree_flatten(self._forward(*args, **kwargs))
        self.constants = {i: v for i, v in enumerate(leaves) if not torch.is_tensor(v)}
        return tuple(v for v in leaves if torch.is_tensor(v))


@dataclass
class _Instance:
    piece: _Piece
    graphed: Callable
    busy: bool = False


class _Release(torch.autograd.Function):
    """Marks a graph instance free when gradient reaches its outputs.

    Its backward runs just before the graphed backward, in the same backward pass, so no forward
    can reuse the instance in between; it also sets the ``grad_added_to_main_grad`` flags the
    replayed backward does not set.
    """

    @staticmethod
    def forward(ctx, instance: _Instance, *outputs: Tensor):
        ctx.instance = instance
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        instance = ctx.instance
        for param in instance.piece.fused_params:
            param.grad_added_to_main_grad = True
        instance.busy = False
        return (None, *grads)


#: Why a call with packed (THD) micro-batches runs a piece eager that reads their boundaries on
#: the host (``GraphPiece.packed`` False).
PACKED_REASON = (
    "packed (THD) micro-batches: this piece reads their sequence boundaries on the host, and "
    "their count and lengths change per micro-batch; padded rows of one length replay graphs"
)


def _split(args: tuple, kwargs: dict, packed_reason: str | None = PACKED_REASON):
    """``(tensors, rebuild, key)`` of a call, or a string saying why it cannot be graphed.

    ``packed_reason``: None where the piece takes fixed-size packed boundaries
    (``GraphPiece.packed``); a ``PackedSeqParams`` argument then becomes its two boundary
    tensors (graph inputs, whose values change per replay) and a template of the rest, whose
    row length is part of the key. Else why packed calls run eager."""
    tensors, positions, constants, templates = [], [], [], []
    named = [(i, v) for i, v in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if torch.is_tensor(value):
            positions.append(name)
            tensors.append(value)
        elif isinstance(value, _SCALARS):
            constants.append((name, value))
        elif isinstance(value, PackedSeqParams):
            fixed = packed_reason or fixed_capacity_params(value)
            if isinstance(fixed, str):
                return fixed
            boundaries = (fixed.cu_seqlens_q, fixed.cu_seqlens_q_padded)
            positions += [(name, "cu_seqlens"), (name, "cu_seqlens_padded")]
            tensors += boundaries
            templates.append((name, fixed.with_boundaries(None, None)))
        else:
            return f"argument {name!r} is a {type(value).__name__}"
    signature = tuple(
        (name, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
        for name, t in zip(positions, tensors, strict=True)
    )
    # Boundaries of one capacity differ only in the row's length (max_seqlen, total_tokens).
    packed_key = tuple((name, t.total_tokens) for name, t in templates)
    count = len(args)

    def rebuild(values: tuple[Tensor, ...]):
        merged = dict(constants)
        merged.update(zip(positions, values, strict=True))
        for name, template in templates:
            merged[name] = template.with_boundaries(
                merged.pop((name, "cu_seqlens")), merged.pop((name, "cu_seqlens_padded"))
            )
        return tuple(merged[i] for i in range(count)), {
            k: v for k, v in merged.items() if not isinstance(k, int)
        }

    return tensors, rebuild, (signature, tuple(constants), packed_key)


def _key_difference(key: tuple, captured: tuple) -> str:
    """What a call's signature has that a captured one has not: the first argument whose shape,
    stride, dtype, device or ``requires_grad`` differs, else the constants or packed lengths
    (a warning names it, so that what varies per call can be fixed)."""
    (signature, constants, packed), (old_signature, old_constants, old_packed) = key, captured
    for new, old in zip(signature, old_signature, strict=False):
        if new != old:
            return f"argument {new[0]!r}: {new[1:]} against {old[1:]} captured"
    if len(signature) != len(old_signature):
        return f"{len(signature)} tensor arguments against {len(old_signature)} captured"
    if constants != old_constants:
        return f"constants {constants} against {old_constants} captured"
    return f"packed rows {packed} against {old_packed} captured"


def _fresh_grad(param: Tensor, grad: Tensor) -> Tensor:
    """A gradient in its own memory, never the graph's static buffer (see the module doc); a
    fused parameter's placeholder as it is."""
    if getattr(param, "grad_added_to_main_grad", False):
        return grad
    return grad.clone()


class GraphedForward:
    """Replaces a piece's ``forward``: replays a CUDA graph per input signature.

    Attributes:
        name: the piece's module name in the model.
        captures: graphs captured so far; ``replays``: forwards that replayed one.
        eager_calls: reason -> number of calls that ran the original forward.
        disabled: why the piece runs eager for good (a failed capture), or None.
    """

    def __init__(
        self, module: nn.Module, name: str, capture: CaptureFunction, *, packed: bool = False
    ):
        self.module, self.name, self.capture = module, name, capture
        #: Why packed micro-batches run eager, or None: they replay.
        self.packed_reason: str | None = None if packed else PACKED_REASON
        self.original = module.forward
        self.instances: dict[tuple, list[_Instance]] = {}
        self.captures = self.replays = 0
        self.eager_calls: dict[str, int] = {}
        self.disabled: str | None = None
        self.hooks = [
            p.register_hook(functools.partial(_fresh_grad, p))
            for p in module.parameters()
            if p.requires_grad
        ]

    def _eager(self, reason: str, args, kwargs):
        self.eager_calls[reason] = self.eager_calls.get(reason, 0) + 1
        return self.original(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.disabled is not None:
            return self._eager(self.disabled, args, kwargs)
        if not (self.module.training and torch.is_grad_enabled()):
            return self._eager("no backward (eval or no_grad) would free a graph", args, kwargs)
        split = _split(args, kwargs, self.packed_reason)
        if isinstance(split, str):
            return self._eager(split, args, kwargs)
        tensors, rebuild, key = split
        instance = self._take(key, tensors, rebuild)
        if isinstance(instance, str):
            return self._eager(instance, args, kwargs)
        instance.busy = True
        self.replays += 1
        outputs = list(instance.graphed(*tensors))
        grads = [i for i, o in enumerate(outputs) if o.requires_grad]
        if grads:
            marked = _Release.apply(instance, *(outputs[i] for i in grads))
            for i, value in zip(grads, marked, strict=True):
                outputs[i] = value
        else:
            instance.busy = False
        piece = instance.piece
        leaves, tensors_out = [], iter(outputs)
        for i in range(piece.out_spec.num_leaves):
            leaves.append(piece.constants[i] if i in piece.constants else next(tensors_out))
        return tree_unflatten(leaves, piece.out_spec)

    def _take(self, key, tensors, rebuild) -> _Instance | str:
        if key not in self.instances and len(self.instances) >= MAX_SIGNATURES:
            reason = (
                f"more than {MAX_SIGNATURES} input shapes (variable-length micro-batches; "
                "batches of one fixed size replay one graph)"
            )
            if reason not in self.eager_calls:
                logger.warning(
                    "CUDA graph of %s: new shapes run eager: %s (this call's %s)",
                    self.name, reason, _key_difference(key, next(iter(self.instances))),
                )  # fmt: skip
            return reason
        pool = self.instances.setdefault(key, [])
        for instance in pool:
            if not instance.busy:
                return instance
        if len(pool) >= MAX_INSTANCES:
            return f"more than {MAX_INSTANCES} graphs of one signature in flight"
        piece = _Piece(self.module, self.original, rebuild)
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        try:
            graphed = self.capture(piece, sample)
        except GraphCaptureError as error:
            if key[2]:  # packed boundaries: this piece's device-only path did not run
                self.packed_reason = f"packed micro-batches: capture failed: {error}"
                logger.warning("CUDA graph of %s: %s", self.name, self.packed_reason)
                return self.packed_reason
            self.disabled = f"capture failed: {error}"
            logger.warning("CUDA graph of %s runs eager: %s", self.name, self.disabled)
            return self.disabled
        self.captures += 1
        instance = _Instance(piece, graphed)
        pool.append(instance)
        return instance


@dataclass
class CudaGraphReport:
    """What :func:`enable_cuda_graphs` graphed and what stays eager.

    Attributes:
        graphed: module name -> its :class:`GraphedForward`.
        eager: ``"<module name> (<piece>)"`` -> why it runs eager.
    """

    graphed: dict[str, GraphedForward] = field(default_factory=dict)
    eager: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per piece: graphed (captures, replays, eager calls) or eager and why."""
        lines = [
            (
                f"graphed {name}: {g.captures} captures, {g.replays} replays"
                + (f", eager calls {g.eager_calls}" if g.eager_calls else "")
                if g.disabled is None
                else f"eager   {name}: {g.disabled}"
            )
            for name, g in self.graphed.items()
        ]
        lines += [f"eager   {name}: {reason}" for name, reason in self.eager.items()]
        return "\n".join(lines)


def graphs_digest(model) -> str:
    """What the graphed pieces of ``model`` did, said once (``train`` prints it after its first
    step): how many replayed, and each reason a graphed piece ran eager, with how many pieces
    and calls it held back (pieces eager by design are in :meth:`CudaGraphReport.summary`).

    Args:
        model: HybridModel chunks built with ``hybrid_cuda_graphs`` (their wrappers, or a list).
    """
    pieces = []
    for chunk in model if isinstance(model, list | tuple) else [model]:
        report = getattr(_unwrap(chunk), "hybrid_cuda_graphs", None)
        pieces += report.graphed.values() if report else []
    return _digest(pieces)


def _digest(pieces: list[GraphedForward]) -> str:
    reasons: dict[str, list[int]] = {}
    for piece in pieces:
        calls = dict(piece.eager_calls)
        if piece.disabled is not None:
            calls.setdefault(piece.disabled, 0)
        for reason, count in calls.items():
            held, total = reasons.get(reason, (0, 0))
            reasons[reason] = [held + 1, total + count]
    text = f"{sum(1 for g in pieces if g.replays)} of {len(pieces)} graphed pieces replay"
    for reason, (held, calls) in sorted(reasons.items(), key=lambda item: -item[1][1]):
        text += f"; {held} ran eager ({calls} calls): {reason}"
    return text


def _unwrap(model: nn.Module) -> nn.Module:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module  # DDP, Float16Module
    return model


def enable_cuda_graphs(model, *, capture: CaptureFunction = capture_cuda_graph) -> CudaGraphReport:
    """Graph the capturable pieces of a HybridModel (or model chunks, or their wrappers).

    Args:
        model: a HybridModel, a wrapper of one (``Float16Module``, DDP), or a list of chunks.
        capture: ``(piece, sample_args) -> graphed piece``; tests pass a stand-in.

    On a GPU this thread moves to a side stream first (:func:`~megatron_hybrid.schedule.
    graph_capture.use_side_stream`, as megatron-core does), so call it before megatron's DDP
    wraps the model (``HybridModel(hybrid_cuda_graphs=True)`` does): DDP's gradient
    accumulators made on the default stream make every backward capture fail.

    Returns:
        What was graphed and what stays eager, with the reasons (also set as each HybridModel
        chunk's ``hybrid_cuda_graphs``).

    Raises:
        ValueError: a config setting the graphs cannot capture (see
            :func:`check_cuda_graph_config`), or pieces that are graphed already.
    """
    if capture is capture_cuda_graph:
        use_side_stream()
    report = CudaGraphReport()
    for chunk in model if isinstance(model, list | tuple) else [model]:
        chunk = _unwrap(chunk)
        check_cuda_graph_config(chunk.config)
        names = {id(m): n for n, m in chunk.named_modules()}
        for symbol, layer in chunk.decoder.iter_physical_layers():
            for piece_name, piece in layer_runtime(symbol).graph_pieces(layer).items():
                name = names[id(piece.module)]
                if piece.reason is not None:
                    report.eager[f"{name} ({piece_name})"] = piece.reason
                    continue
                if isinstance(piece.module.forward, GraphedForward):
                    raise ValueError(f"{name} is graphed already; call enable_cuda_graphs once")
                graphed = GraphedForward(piece.module, name, capture, packed=piece.packed)
                piece.module.forward = graphed
                report.graphed[name] = graphed
        if getattr(chunk, "mtp", None) is not None:
            report.eager["mtp"] = "MTP depths are not graphed"
        if hasattr(chunk, "hybrid_cuda_graphs"):  # HybridModel: sizes its rotary table for them
            chunk.hybrid_cuda_graphs = report
    return report


def disable_cuda_graphs(report: CudaGraphReport) -> None:
    """Give every graphed piece of ``report`` its original forward back (graphs are dropped)."""
    for graphed in report.graphed.values():
        del graphed.module.forward  # the instance attribute; the class's forward shows again
        graphed.instances.clear()
        for hook in graphed.hooks:
            hook.remove()
    report.graphed.clear()

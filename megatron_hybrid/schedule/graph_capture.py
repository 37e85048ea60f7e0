"""Capturing one piece with ``torch.cuda.make_graphed_callables``, and undoing a failed capture.

:func:`capture_cuda_graph` is the default capture of :mod:`~megatron_hybrid.schedule.graphs`:
warm-up on a side stream (three iterations), then one forward and one backward graph, captured
in ``thread_local`` mode; gradients and buffers the warm-up touched are restored afterwards.

A capture that fails (an operation capture forbids, such as a host synchronisation) used to
leave the process broken (torch 2.11, seen on one H100): ``torch.cuda.graph.__exit__`` calls
``capture_end``, whose ``cudaStreamEndCapture`` then raises before the rest of its work
(torch's ``aten/src/ATen/cuda/CUDAGraph.cpp``), so

* the CUDA generator stays in its capture state: the next random number outside a graph dies
  with "Offset increment outside graph capture encountered unexpectedly";
* the caching allocator keeps the graph's private memory pool in use: what the capture
  allocated stays reserved and unusable (34.7 GiB in one run of ``benchmarks/mfu.py``, which then
  ran out of memory in the next run);
* the side stream stays current (``__exit__`` never leaves its stream context);
* the error reported is the capture's end ("operation failed due to a previous error during
  capture"), not the operation that failed.

So the capture here saves the generator's state first (``clone_state``: a copy outside any
capture), captures into a memory pool of its own, and on failure puts the generator's state
back, ends and releases that pool (only where the capture never ended, so nothing else releases
it) and frees its memory; ``thread_local`` capture leaves its stream context whatever
``capture_end`` does, and reports the operation that failed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = [
    "GraphCaptureError",
    "capture_cuda_graph",
    "reached_parameters",
    "thread_local_capture",
    "use_side_stream",
]

logger = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    """A piece could not be captured; it runs eager from then on."""


#: What a capture that fails this way needs (see :func:`use_side_stream`).
_LEGACY_STREAM_HINT = (
    " (a parameter's gradient accumulator was made on the default stream, e.g. by megatron's DDP "
    "wrapping the model before its pieces were graphed: graph them first, HybridModel("
    "hybrid_cuda_graphs=True) or enable_cuda_graphs, then wrap)"
)


def use_side_stream() -> None:
    """Make a side stream this thread's current CUDA stream, where the default stream is.

    A parameter's gradient accumulator (autograd's ``AccumulateGrad`` node, which megatron's DDP
    keeps to hook it) records the stream that was current when it was made, and a captured
    backward that reaches it makes that stream wait on the capture stream: CUDA refuses that for
    the legacy default stream ("operation would make the legacy stream depend on a capturing
    blocking stream", every piece of a model in megatron's DDP on one H200 with torch 2.11).
    megatron-core 0.19.2 moves to a side stream for the same reason when it sets up its graphs
    (``transformer/cuda_graphs.py``, ``CudaGraphManager.__init__``); DDP, wrapping the model
    afterwards, then makes its accumulators there. Without CUDA this does nothing.
    """
    if torch.cuda.is_available() and torch.cuda.current_stream() == torch.cuda.default_stream():
        torch.cuda.set_stream(torch.cuda.Stream())


@contextlib.contextmanager
def thread_local_capture() -> Iterator[None]:
    """Capture in ``thread_local`` mode inside ``make_graphed_callables``.

    Its default, ``global``, fails the capture when another thread makes a CUDA call that capture
    forbids, such as the NCCL watchdog querying events; megatron-core 0.19.2 captures in
    ``thread_local`` mode for that reason (``transformer/cuda_graphs.py``). torch offers no
    argument for it, so ``torch.cuda.graph`` is swapped for the duration of the call. The swapped
    class also leaves its stream context when ``capture_end`` raises, and lets the error of the
    captured code (the cause) through rather than ``capture_end``'s.
    """
    original = torch.cuda.graph

    class ThreadLocalGraph(original):
        def __init__(self, cuda_graph, *args, **kwargs):
            kwargs.setdefault("capture_error_mode", "thread_local")
            super().__init__(cuda_graph, *args, **kwargs)

        def __exit__(self, *exc_info):
            try:
                self.cuda_graph.capture_end()
            except Exception:
                if exc_info[0] is None:
                    raise  # capture_end's own failure; else the captured code's error is the cause
            finally:
                self.stream_ctx.__exit__(*exc_info)
            return False

    torch.cuda.graph = ThreadLocalGraph
    try:
        yield
    finally:
        torch.cuda.graph = original


@contextlib.contextmanager
def _rng_forks_suspended() -> Iterator[None]:
    """Make megatron's RNG-tracker forks no-ops while a piece is captured.

    megatron-core forks its CUDA RNG tracker around every dropout call, dropout 0 included
    (``transformer/dot_product_attention.py``), and a tracker that is not graph-safe re-seeds
    the CUDA generator there, which stream capture refuses ("set_current_seed can be called
    during stream capture only if new seed is the same", seen on one H100 with torch 2.11).
    Graphed pieces draw no random numbers (pieces with dropout stay eager), so the fork changes
    nothing they compute, except the router's random logits under
    ``moe_router_force_load_balancing`` (a benchmark setting): captured, they are drawn from the
    default CUDA generator instead of the expert-parallel tracker, so a graphed run routes
    otherwise than an eager one, and every expert-parallel rank draws the same stream (each
    rank's routing is still balanced). A graph-safe tracker is left alone.
    """
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        is_graph_safe_cuda_rng_tracker,
    )

    tracker = get_cuda_rng_tracker()
    suspend = not is_graph_safe_cuda_rng_tracker(tracker)
    if suspend:
        tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        if suspend:
            del tracker.fork  # the class's method again


class _ProcessState:
    """What a capture changes in the process: the CUDA generator's state and the graph's memory
    pool, saved before the capture and put back by :meth:`recover` after a failed one."""

    def __init__(self, device: torch.device):
        self.pool = self.generator = self.rng = None
        if device.type != "cuda":  # a stand-in capture (tests)
            return
        self.device = device.index if device.index is not None else torch.cuda.current_device()
        self.pool = torch.cuda.graph_pool_handle()
        self.generator = torch.cuda.default_generators[self.device]
        self.rng = self.generator.clone_state()  # a copy outside any capture

    def recover(self) -> list[str]:
        """Put the generator's state back, end and release the pool where the capture never
        ended, free the memory; returns what could not be undone."""
        problems = []
        if self.generator is None:
            return problems
        try:
            self.generator.graphsafe_set_state(self.rng)
        except RuntimeError as error:
            problems.append(f"generator state: {error}")
        try:  # raises where no capture into the pool is under way (it ended, or never began)
            torch._C._cuda_endAllocateToPool(self.device, self.pool)
        except RuntimeError:
            pass
        else:  # the failed graph never ended its capture: nothing else releases the pool
            try:
                torch._C._cuda_releasePool(self.device, self.pool)
            except RuntimeError as error:
                problems.append(f"memory pool: {error}")
        gc.collect()
        torch.cuda.empty_cache()
        return problems


def _main_grads(module: nn.Module) -> Iterator[tuple[Tensor, str, Tensor]]:
    for param in module.parameters():
        for attribute in ("main_grad", "grad"):
            value = getattr(param, attribute, None)
            if torch.is_tensor(value):
                yield param, attribute, value


def reached_parameters(piece: nn.Module, sample_args: tuple[Tensor, ...]) -> list[Tensor]:
    """The parameters of ``piece`` that autograd reaches from its outputs, in parameter order.

    One forward on ``sample_args``, whose autograd graph is walked and dropped. A parameter it
    does not reach gets no gradient through autograd: frozen ones, and the grouped experts'
    weights where megatron DDP's hooks are idle (``modules/fast/grouped_linear.py``: their
    backward adds into ``main_grad`` itself, and autograd does not know them). Those need not
    be graph inputs: as inputs, each replayed backward ran autograd's accumulator node and
    DDP's hook for every one (4,096 per ``[*E]{4}`` step of 8 micro-batches: about 36 ms of
    host time in one profiled step on one H200, torch 2.11) to deliver nothing.
    """
    with torch.enable_grad():
        outputs = piece(*sample_args)
    nodes = [o.grad_fn for o in outputs if torch.is_tensor(o) and o.grad_fn is not None]
    reached = {id(o) for o in outputs if torch.is_tensor(o) and o.requires_grad and o.is_leaf}
    seen = set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            reached.add(id(variable))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    del outputs
    return [p for p in piece.parameters() if id(p) in reached]


class _WithGraphInputs(nn.Module):
    """``piece`` whose extra graph inputs (``make_graphed_callables`` takes a module's
    ``parameters()``) are ``params`` only; ``piece``'s own parameter list is left whole."""

    def __init__(self, piece: nn.Module, params: list[Tensor]):
        super().__init__()
        object.__setattr__(self, "piece", piece)  # not a child: its parameters are not ours
        self.graph_params = tuple(params)

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]:
        return iter(self.graph_params)

    def forward(self, *args: Tensor):
        return self.piece(*args)


def _on_cuda(tensors: tuple[Tensor, ...]) -> bool:
    return all(t.is_cuda for t in tensors)


def capture_cuda_graph(piece: nn.Module, sample_args: tuple[Tensor, ...]):
    """Capture ``piece`` with ``torch.cuda.make_graphed_callables`` (see the module doc).

    Raises:
        GraphCaptureError: the inputs are not on a CUDA device, or capture failed (the process
            then is as it was before the capture).
    """
    if not _on_cuda(sample_args):
        raise GraphCaptureError("inputs are not on a CUDA device")
    saved = [(p, a, v.clone()) for p, a, v in _main_grads(piece)]
    buffers = [(b, b.clone()) for b in piece.buffers()]
    params = list(piece.parameters())
    flags = [getattr(p, "grad_added_to_main_grad", None) for p in params]
    for param in params:
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = False
    state = _ProcessState(sample_args[0].device)
    failure = None
    try:
        with thread_local_capture(), _rng_forks_suspended():
            inputs = _WithGraphInputs(piece, reached_parameters(piece, sample_args))
            graphed = torch.cuda.make_graphed_callables(
                inputs, sample_args, num_warmup_iters=3, allow_unused_input=True, pool=state.pool
            )
    except (RuntimeError, AssertionError) as error:
        # Recovered below, once the error's traceback (which holds the failed graphs) is gone.
        failure = f"{type(error).__name__}: {error}"
        if "legacy stream" in failure:
            failure += _LEGACY_STREAM_HINT
    finally:
        # Parameters whose fused main_grad add the captured backward contains.
        piece.fused_params = [p for p in params if getattr(p, "grad_added_to_main_grad", False)]
        for param, flag in zip(params, flags, strict=True):
            if flag is not None:
                param.grad_added_to_main_grad = flag
        for param, attribute, value in saved:
            getattr(param, attribute).copy_(value)
        for buffer, value in buffers:
            buffer.copy_(value)
    if failure is not None:
        problems = state.recover()
        if problems:
            logger.warning("after a failed CUDA graph capture, not undone: %s", problems)
        raise GraphCaptureError(failure)
    return graphed

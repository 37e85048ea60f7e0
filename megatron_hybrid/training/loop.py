"""The pieces of a training step: wrapped model chunks and the step itself (the optimizer:
:mod:`megatron_hybrid.training.optimizers`).

Gradients are finalized the way megatron-core expects: the model chunks are wrapped in
megatron's ``DistributedDataParallel``, the loss is a per-token sum and ``finalize_model_grads``
all-reduces gradients over data-parallel ranks and divides them by the global token count. So a
step over one global batch gives the same gradients (and gradient norm) whatever the
data-parallel size. ``train_step``'s fused optimizer step takes that division where AdamW reads
the gradients (:func:`deferred_gradient_scaling`), together with the clip.

"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

from megatron_hybrid.checkpointing.finite import first_nonfinite, nonfinite_on_any_rank
from megatron_hybrid.model import HybridModel
from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.modules.fast import mark_idle_grad_hooks
from megatron_hybrid.pattern import ParsedPattern
from megatron_hybrid.schedule.steps import LM_LOSS, lm_forward_step, run_schedule
from megatron_hybrid.training.optimizer_step import (
    apply_step,
    fused_step_enabled,
    guard_statistics,
)
from megatron_hybrid.training.optimizers import distributed_optimizer
from megatron_hybrid.training.param_order import (
    EXPERTS_ORDER,
    MEGATRON_ORDER,
    buffer_layout,
    mark_chunk,
)
from megatron_hybrid.training.phases import PhaseTimer, phase

__all__ = [
    "StepResult",
    "TrainDistributedDataParallel",
    "all_finite",
    "build_model_chunks",
    "deferred_gradient_scaling",
    "first_nonfinite_parameter",
    "take_deferred_scaling",
    "train_step",
    "wrap_model_chunks",
]


def build_model_chunks(
    config,
    pattern: str | ParsedPattern,
    pg_collection,
    *,
    backend: str,
    vocab_size: int,
    max_sequence_length: int,
    share_embeddings_and_output_weights: bool = True,
    position_embedding_type: str = "rope",
    mamba_impl: str = "auto",
    stack_spec=None,
    prepare=None,
    param_order: str = EXPERTS_ORDER,
    **model_kwargs,
) -> list:
    """HybridModel chunks of this rank (one per virtual stage), wrapped for training.

    ``stack_spec`` replaces ``hybrid_stack_spec(backend, mamba_impl=mamba_impl)`` (a Hugging
    Face start passes its family's, see ``megatron_hybrid.hf.api.stack_spec_for``);
    ``prepare(models)`` changes the chunks before megatron's DDP wraps them (whose gradient
    buffers hold the parameters that train then: LoRA adapters go on here);
    ``param_order`` is :func:`wrap_model_chunks`'s; ``model_kwargs`` are further HybridModel
    arguments (``rotary_percent``, ``rotary_base``).
    """
    from megatron.core.transformer.module import Float16Module

    # train_step's loss is a per-token sum; the routers read the flag when they are built.
    config.calculate_per_token_loss = True
    spec = stack_spec or hybrid_stack_spec(backend, config=config, mamba_impl=mamba_impl)
    pp = pg_collection.pp
    vpp = config.virtual_pipeline_model_parallel_size
    models = []
    for vp_stage in range(vpp) if vpp else [None]:
        last_vp = vp_stage is None or vp_stage == vpp - 1
        model = HybridModel(
            config,
            spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            hybrid_layer_pattern=pattern,
            pre_process=pp.rank() == 0 and (vp_stage is None or vp_stage == 0),
            post_process=pp.rank() == pp.size() - 1 and last_vp,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            **model_kwargs,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        models.append(model)
    if prepare is not None:
        prepare(models)
    return wrap_model_chunks(models, config, pg_collection, param_order=param_order)


class TrainDistributedDataParallel(DistributedDataParallel):
    """megatron's ``DistributedDataParallel`` as :func:`wrap_model_chunks` builds it: the same
    buffers, hooks and collectives; only :meth:`scale_gradients` runs another kernel.

    ``finalize_model_grads`` divides the gradients by the step's token count with
    ``scale_gradients(1 / num_tokens)``, a 0-d CUDA tensor, and megatron-core 0.19.2's buffers
    multiply by it one at a time (``param_and_grad_buffer.py``, ``grad_data *= factor``), which
    torch runs as its unvectorised broadcast kernel: 10 launches, 2.6 ms of a profiled 0.166 s
    ``[*E]`` step of ``benchmarks/mfu.py`` on one H200, about 3 TB/s over the float32 buffers.
    """

    #: Where :meth:`scale_gradients` puts its factor instead of applying it (``train_step``
    #: sets it around its schedule when its optimizer step applies the factor); None: applied.
    deferred_scaling: list | None = None

    @property
    def scales_in_one_pass(self) -> bool:
        """Whether every buffer scales as megatron-core 0.19.2's ``_ParamAndGradBuffer`` does
        (then the factor can also be deferred)."""
        buffers = self.buffers + self.expert_parallel_buffers
        return all(type(b).scale_gradients is _ParamAndGradBuffer.scale_gradients for b in buffers)

    def scale_gradients(self, scaling_factor) -> None:
        """Every buffer's gradients (and extra main grads) times ``scaling_factor`` in one
        ``torch._foreach_mul_``: each element times the same float32, so bit for bit
        megatron's result; or, while :attr:`deferred_scaling` is a list, the factor appended
        to it and nothing multiplied. A buffer whose class scales in its own way keeps
        megatron's loop."""
        if not self.scales_in_one_pass:
            super().scale_gradients(scaling_factor)
            return
        if self.deferred_scaling is not None:
            self.deferred_scaling.append((self, scaling_factor))
            return
        buffers = self.buffers + self.expert_parallel_buffers
        grads = [grad for b in buffers for grad in (b.grad_data, *b.extra_main_grads)]
        if grads:
            torch._foreach_mul_(grads, scaling_factor)


@contextmanager
def deferred_gradient_scaling(chunks, wanted: bool = True) -> Iterator[list]:
    """While inside, ``finalize_model_grads``'s division by the token count is recorded, not
    applied, where every chunk can defer it (:class:`TrainDistributedDataParallel` with
    megatron's buffers; else nothing is deferred). Yields the list of recorded ``(chunk,
    factor)`` pairs; use :func:`take_deferred_scaling` on it afterwards."""
    deferring = wanted and all(
        isinstance(chunk, TrainDistributedDataParallel) and chunk.scales_in_one_pass
        for chunk in chunks
    )
    factors: list = []
    if deferring:
        for chunk in chunks:
            chunk.deferred_scaling = factors
    try:
        yield factors
    finally:
        for chunk in chunks:
            if isinstance(chunk, TrainDistributedDataParallel):
                chunk.deferred_scaling = None


def take_deferred_scaling(chunks, factors: list) -> torch.Tensor | None:
    """The one factor the gradients of ``chunks`` still need, or None (none was deferred).
    ``finalize_model_grads`` scales every chunk once by the same tensor; anything else (a chunk
    scaled twice or not at all, different factors) is applied here as recorded, and None
    returned."""
    if not factors:
        return None
    first = factors[0][1]
    recorded = [chunk for chunk, _ in factors]
    if len(recorded) == len(chunks) and all(a is b for a, b in zip(recorded, chunks, strict=True)):
        if all(factor is first for _, factor in factors):
            return first
    for chunk, factor in factors:  # outside the context: applied at once
        chunk.scale_gradients(factor)
    return None


def wrap_model_chunks(
    models: list,
    config,
    pg_collection,
    *,
    optimizer: str = "adam",
    param_order: str = EXPERTS_ORDER,
) -> list:
    """Model chunks (one per virtual stage) wrapped in megatron's ``DistributedDataParallel``
    (:class:`TrainDistributedDataParallel`).

    The one wrapping ``train`` and :class:`~megatron_hybrid.rl.PolicyTrainer` use: gradient
    buffers in float32 for the parameters that require gradients (LoRA runs: the adapters),
    the distributed optimizer's layout on GPUs for Adam (megatron-core 0.19's distributed
    optimizer refuses SGD, ``distrib_optimizer.py``: SGD keeps whole gradients, all-reduced),
    and gradients summed over data-parallel ranks (the step's loss is a sum over tokens that
    ``finalize_model_grads`` divides by the global count; ``train_step``). ``optimizer`` is the
    one :func:`~megatron_hybrid.training.optimizers.build_optimizer` will get. ``param_order``
    is the buffers' order (:mod:`~megatron_hybrid.training.param_order`): by default the routed
    experts' weights lie in expert order, so the grouped GEMM multiplies them where they lie;
    a resume takes the order of the checkpoint it loads.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    # train_step's loss is a per-token sum. DDP reads this flag at construction to pick its
    # gradient scaling (1.0 here, 1/DP otherwise): set later, gradients shrink by 1/DP.
    config.calculate_per_token_loss = True
    chunks = []
    for index, model in enumerate(models):
        # delay_wgrad_compute: TE's backward_dw assigns each micro-batch's weight gradient to
        # .grad; only DDP's wgrad hooks, registered with this flag, add it to main_grad.
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=distributed_optimizer(optimizer),
            delay_wgrad_compute=config.delay_wgrad_compute,
        )
        layout = buffer_layout(model, config, ddp_config, pg_collection, param_order)
        chunk = TrainDistributedDataParallel(
            config,
            ddp_config,
            model,
            disable_bucketing=index > 0,
            pg_collection=pg_collection,
            full_param_layout=layout,
        )
        mark_chunk(chunk, MEGATRON_ORDER if layout is None else param_order)
        mark_idle_grad_hooks(chunk)
        chunks.append(chunk)
    return chunks


@dataclass(frozen=True)
class StepResult:
    """What one step reports (the same on every rank).

    ``finite`` is False when the loss or a gradient was NaN or infinite on some rank; the
    optimizer was then not stepped (the parameters are those before the step), and
    ``nonfinite`` says what was found first (``parameter NAME (rank R)``, ``gradient of NAME
    (rank R)``, ``the loss`` or ``the gradient norm``). ``flops`` are the model FLOPs of the
    global batch (the micro-batches' ``model_flops``, summed over data-parallel ranks; 0 where
    the batches carry none). ``reports`` holds every report of the
    forward step's loss function summed over the global batch (micro-batches and
    data-parallel ranks), by key, for forward steps other than the language model's.
    """

    loss: float
    grad_norm: float
    tokens: int
    finite: bool = True
    nonfinite: str | None = None
    flops: float = 0.0
    reports: dict = field(default_factory=dict)


def all_finite(tensors, pg_collection) -> bool:
    """Whether every tensor on every rank is finite (ranks agree on the answer).

    The model-parallel and data-parallel groups form a grid over all ranks, so reducing over
    one and then the other reaches every rank.
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    # One flag per tensor, read once: no host synchronisation per tensor on GPUs.
    flags = [torch.isfinite(t).all() for t in tensors if t is not None and t.numel()]
    finite = torch.stack(flags).all() if flags else torch.tensor(True)
    bad = (~finite).float().reshape(1).to(device)
    for group in (pg_collection.mp, pg_collection.dp_cp):
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=group)
    return not bool(bad.item())


def first_nonfinite_parameter(chunks) -> str | None:
    """The first NaN or infinite parameter, else gradient, on any rank (collective, world).

    Parameters come first: a non-finite weight makes every gradient behind it non-finite, and
    the weight is what to name. Returns ``"parameter NAME (rank R)"``, ``"gradient of NAME
    (rank R)"`` or None; NAME is the parameter's module path in the unwrapped model.
    """
    from megatron.core.utils import unwrap_model

    named = [(n, p) for chunk in unwrap_model(list(chunks)) for n, p in chunk.named_parameters()]
    local = first_nonfinite((f"parameter {n}", p.detach()) for n, p in named)
    if local is None:
        grads = ((n, getattr(p, "main_grad", None)) for n, p in named)
        local = first_nonfinite((f"gradient of {n}", g) for n, g in grads if g is not None)
    found = nonfinite_on_any_rank(local)
    return None if found is None else f"{found[0]} (rank {found[1]})"


def _configure_hooks(chunks, config, pg_collection, timer=None) -> None:
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = (
        finalize_model_grads
        if timer is None
        else timer.wrap("gradient finalisation", finalize_model_grads)
    )
    config.calculate_per_token_loss = True
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_sync_func = None
    config.param_sync_func = None


def train_step(
    chunks,
    optimizer,
    batches,
    config,
    *,
    seq_length: int,
    micro_batch_size: int,
    pg_collection,
    timer: PhaseTimer | None = None,
    forward_step=lm_forward_step,
    loss_key: str = LM_LOSS,
    while_queued: Callable[[], None] | None = None,
) -> StepResult:
    """One optimizer step over ``batches`` (a list of micro-batch dicts, or one list per chunk).

    Args:
        chunks: the model chunks, wrapped by :func:`wrap_model_chunks`.
        optimizer: from :func:`~megatron_hybrid.training.optimizers.build_optimizer`.
        batches: what ``forward_step`` reads, one item per micro-batch (a dict with
            ``num_tokens``, the real tokens, and ``model_flops`` counts them in the result).
        config: the models' TransformerConfig.
        seq_length, micro_batch_size: the pipeline's tensor shape (``[seq_length,
            micro_batch_size, hidden]``).
        pg_collection: the process groups.
        timer: a :class:`~megatron_hybrid.training.phases.PhaseTimer` (benchmarks) times the
            step's phases, waiting for the device around each; without it nothing waits.
        forward_step: megatron-core's ``forward_step_func``: ``(data_iterator, model) ->
            (output, loss_func)``, where ``loss_func(output)`` returns megatron's per-token
            three-tuple ``(loss_sum, count, {key: report tensor})``; gradients are those of the
            sum of ``loss_sum`` over the global batch divided by the sum of ``count``
            (``calculate_per_token_loss``). Default: the language-model step.
        loss_key: the report whose entries 0 and 1 are the loss sum and its count (the step's
            ``loss`` is their ratio).
        while_queued: called once while the device runs the step: after its last device work
            is queued, before its first read on the host (the fused path: after the update;
            megatron's: after the schedule, before its guard reads the gradients). ``train``
            builds the next step's micro-batches there, so the host builds them while the GPU
            computes instead of after it (work that reads the device waits for the queued step
            instead); under a ``timer`` it is the ``data`` phase.

    Returns:
        The step's loss (summed over the global batch, divided by its count), the gradient norm
        before clipping, the real tokens of the global batch and every report summed.
    """
    _configure_hooks(chunks, config, pg_collection, timer)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    per_chunk = batches if isinstance(batches[0], list) else [batches] * len(chunks)
    fused = fused_step_enabled()
    # The fused step applies the token count's factor where AdamW reads the gradients.
    with phase(timer, "forward-backward"), deferred_gradient_scaling(chunks, fused) as factors:
        reports = run_schedule(chunks, per_chunk, seq_length=seq_length,
                               micro_batch_size=micro_batch_size, forward_only=False,
                               forward_step=forward_step)  # fmt: skip
    scaling = take_deferred_scaling(chunks, factors)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if not fused:  # megatron's guard and optimizer read the device: the step is queued so far
        _while_queued(while_queued, timer)
    with phase(timer, "guard"):
        stats = _step_statistics(reports, per_chunk[0], pg_collection, device, loss_key)
        if fused:
            guard = guard_statistics(optimizer, stats[:2], scaling)
        else:  # megatron's path: every gradient checked before its optimizer.step()
            grads = (getattr(p, "main_grad", None) for chunk in chunks for p in chunk.parameters())
            finite = all_finite([stats[:2], *grads], pg_collection)
    if fused:
        with phase(timer, "optimizer"):
            apply_step(optimizer, guard, _clip_grad(optimizer))
        _while_queued(while_queued, timer)
        # The step's one copy to the host: loss, tokens, FLOPs, norm and the guard's flag.
        loss_sum, loss_tokens, tokens, flops, grad_norm, flagged = torch.cat(
            [stats, guard.norm_and_flag()]
        ).tolist()
        if flagged and scaling is not None and math.isfinite(loss_sum):
            grad_norm, flagged = _step_scaled_first(chunks, optimizer, stats, scaling)
        finite = not flagged
    else:
        grad_norm = float("nan")
        if finite:
            with phase(timer, "optimizer"):
                step = optimizer.step()
            grad_norm = step if isinstance(step, float) else float(step[1])
        loss_sum, loss_tokens, tokens, flops = stats.tolist()
    # The language model reports its loss alone (in the statistics above, with no host read);
    # other forward steps' reports (the policy loss's terms) are summed for the caller, after
    # the update is queued: summing reads them on the host.
    summed = (
        {} if forward_step is lm_forward_step else _summed_reports(reports, pg_collection, device)
    )
    loss = loss_sum / max(loss_tokens, 1.0)
    nonfinite = None
    if not (finite and math.isfinite(grad_norm)):
        # Nothing was applied; name the culprit (a collective: every rank agrees it is needed).
        nonfinite = first_nonfinite_parameter(chunks) or (
            "the gradient norm" if math.isfinite(loss) else "the loss"
        )
    return StepResult(
        loss=loss,
        grad_norm=grad_norm,
        tokens=int(tokens),
        finite=nonfinite is None,
        nonfinite=nonfinite,
        flops=flops,
        reports={key: value.cpu() for key, value in summed.items()},
    )


def _step_scaled_first(chunks, optimizer, stats, scaling) -> tuple[float, float]:
    """A flagged step with the token factor deferred, taken again in megatron's order: the
    gradients divided first, then the norm, clip and update. The unscaled sums' float32 norm
    overflows (above about 1.8e19 over all of them) where the divided gradients' may not; the
    flagged attempt changed nothing (AdamW's kernel skipped on its flag). Returns the norm and
    the flag, as the step's one host read does."""
    for chunk in chunks:
        chunk.scale_gradients(scaling)  # outside the deferral: applied now
    guard = guard_statistics(optimizer, stats[:2])
    apply_step(optimizer, guard, _clip_grad(optimizer))
    grad_norm, flagged = guard.norm_and_flag().tolist()
    return grad_norm, flagged


def _while_queued(work: Callable[[], None] | None, timer: PhaseTimer | None) -> None:
    if work is not None:
        with phase(timer, "data"):
            work()


def _step_statistics(reports, batches, pg_collection, device, loss_key: str) -> torch.Tensor:
    """``[loss sum, loss tokens, real tokens, model FLOPs]`` of the global batch, float64 on the
    device (no host read): the last pipeline stage's losses and every rank's micro-batches,
    summed over data-parallel ranks, the losses shared with the other pipeline stages."""
    losses = [report[loss_key][:2].double().to(device) for report in reports]
    if losses:
        loss = torch.stack(losses).sum(0)
    else:
        loss = torch.zeros(2, dtype=torch.float64, device=device)
    tokens = sum(b.get("num_tokens", 0) for b in batches)
    flops = sum(b.get("model_flops", 0.0) for b in batches)
    counts = torch.tensor([tokens, flops], dtype=torch.float64)
    if torch.device(device).type == "cuda":
        # A copy from pageable memory waits for the stream (the whole backward); from pinned
        # memory it is queued like a kernel.
        counts = counts.pin_memory()
    stats = torch.cat([loss, counts.to(device, non_blocking=True)])
    torch.distributed.all_reduce(stats, group=pg_collection.dp_cp)
    torch.distributed.all_reduce(stats[:2], group=pg_collection.pp)  # only the last stage adds
    return stats


def _clip_grad(optimizer) -> float:
    """The clipping norm of ``CPUOptimizer`` or of a megatron optimizer's config."""
    if hasattr(optimizer, "clip_grad"):
        return optimizer.clip_grad
    return optimizer.config.clip_grad


def _summed_reports(reports: list[dict], pg_collection, device) -> dict:
    """Every key's report tensors summed over micro-batches and data-parallel ranks, in float64,
    on every rank (only the last pipeline stage has them; the others add zeros)."""
    keys = sorted({key for report in reports for key in report})
    keys = _same_keys(keys, pg_collection)
    summed = {}
    for key in keys:
        local = [report[key].double().reshape(-1).cpu() for report in reports if key in report]
        size = torch.tensor([max((t.numel() for t in local), default=0)], device=device)
        torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX)
        total = torch.zeros(int(size.item()), dtype=torch.float64)
        for t in local:
            total += t
        total = total.to(device)
        torch.distributed.all_reduce(total, group=pg_collection.dp_cp)
        torch.distributed.all_reduce(total, group=pg_collection.pp)  # only the last stage adds
        summed[key] = total
    return summed


def _same_keys(keys: list[str], pg_collection) -> list[str]:
    """The report keys of the last pipeline stage, known on every rank."""
    if pg_collection.pp.size() == 1:
        return keys
    shared = [keys]
    last = torch.distributed.get_global_rank(pg_collection.pp, pg_collection.pp.size() - 1)
    torch.distributed.broadcast_object_list(shared, src=last, group=pg_collection.pp)
    return shared[0]

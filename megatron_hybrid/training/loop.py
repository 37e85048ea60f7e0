"""The pieces of a training step: wrapped model chunks, the optimizer and the step itself.

Gradients are finalized the way megatron-core expects: the model chunks are wrapped in
megatron's ``DistributedDataParallel``, the loss is a per-token sum and ``finalize_model_grads``
all-reduces gradients over data-parallel ranks and divides them by the global token count. So a
step over one global batch gives the same gradients (and gradient norm) whatever the
data-parallel size.

On GPUs the optimizer is megatron-core's distributed optimizer. Its implementation hard-codes
CUDA, so on CPU a ``torch.optim.AdamW`` over the same main gradients stands in, with the
gradient norm computed over model-parallel shards as megatron computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_hybrid.checkpointing.finite import first_nonfinite, nonfinite_on_any_rank
from megatron_hybrid.model import HybridModel
from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.pattern import ParsedPattern
from megatron_hybrid.schedule.steps import lm_forward_step
from megatron_hybrid.training.optimizer_step import (
    NormGroup,
    apply_step,
    fused_step_enabled,
    guard_statistics,
    use_fused_adam,
)
from megatron_hybrid.training.phases import PhaseTimer, phase

__all__ = [
    "CPUOptimizer",
    "StepResult",
    "all_finite",
    "build_model_chunks",
    "build_optimizer",
    "first_nonfinite_parameter",
    "train_step",
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
    **model_kwargs,
) -> list:
    """HybridModel chunks of this rank (one per virtual stage), wrapped for training.

    ``stack_spec`` replaces ``hybrid_stack_spec(backend, mamba_impl=mamba_impl)`` (a Hugging
    Face start passes its family's, see ``megatron_hybrid.hf.api.stack_spec_for``);
    ``prepare(models)`` changes the chunks before megatron's DDP wraps them (whose gradient
    buffers hold the parameters that train then: LoRA adapters go on here);
    ``model_kwargs`` are further HybridModel arguments (``rotary_percent``, ``rotary_base``).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    # train_step's loss is a per-token sum. DDP reads this flag at construction to pick its
    # gradient scaling (1.0 here, 1/DP otherwise): set later, gradients shrink by 1/DP.
    config.calculate_per_token_loss = True
    spec = stack_spec or hybrid_stack_spec(backend, config=config, mamba_impl=mamba_impl)
    pp = pg_collection.pp
    vpp = config.virtual_pipeline_model_parallel_size
    on_gpu = torch.cuda.is_available()
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
        if on_gpu:
            model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        models.append(model)
    if prepare is not None:
        prepare(models)
    chunks = []
    for vp_stage, model in zip(range(vpp) if vpp else [None], models, strict=True):
        # delay_wgrad_compute: TE's backward_dw assigns each micro-batch's weight gradient to
        # .grad; only DDP's wgrad hooks, registered with this flag, add it to main_grad.
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=on_gpu,
            delay_wgrad_compute=config.delay_wgrad_compute,
        )
        chunks.append(
            DistributedDataParallel(
                config,
                ddp_config,
                model,
                disable_bucketing=vp_stage not in (None, 0),
                pg_collection=pg_collection,
            )
        )
    return chunks


class CPUOptimizer:
    """AdamW over megatron's ``main_grad`` buffers, with global-norm clipping (CPU runs)."""

    def __init__(self, chunks, *, lr: float, weight_decay: float, clip_grad: float, pg_collection):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.clip_grad = clip_grad
        self.pg_collection = pg_collection
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)

    def _grad_norm(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        dense = torch.zeros(1, dtype=torch.float64)
        expert = torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            if p.grad is None or not param_is_not_shared(p):
                continue
            if not param_is_not_tensor_parallel_duplicate(p):
                continue
            target = expert if not getattr(p, "allreduce", True) else dense
            target += p.grad.double().pow(2).sum()
        # Each dense shard lives once in the TP x PP group, each expert shard once in TP x EP x PP.
        torch.distributed.all_reduce(dense, group=self.pg_collection.mp)
        torch.distributed.all_reduce(expert, group=self.pg_collection.tp_ep_pp)
        return math.sqrt(float(dense + expert))

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's parameter groups (the learning-rate scheduler sets their ``lr``)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def prepare_grads(self) -> bool:
        """Copy the main gradients to ``.grad`` (megatron's optimizer's name for it)."""
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else None
        return False

    def norm_groups(self) -> list[NormGroup]:
        """The dense and the expert gradients, each summed once over its model-parallel group
        (shared and tensor-parallel duplicate parameters left out of the norm)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        groups = {
            True: NormGroup([], [], self.pg_collection.mp),
            False: NormGroup([], [], self.pg_collection.tp_ep_pp),
        }
        for p in self.params:
            if p.grad is None:
                continue
            group = groups[getattr(p, "allreduce", True)]
            group.clip_grads.append(p.grad)
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                group.norm_grads.append(p.grad)
        return list(groups.values())

    def step_with_ready_grads(self) -> bool:
        """Update with the (clipped) gradients."""
        self.optimizer.step()
        return True

    def step(self) -> float:
        """Copy main grads, clip by global norm, update; return the norm before clipping (the
        reference path, ``MEGATRON_HYBRID_FUSED_STEP=0``)."""
        self.prepare_grads()
        norm = self._grad_norm()
        if self.clip_grad and norm > self.clip_grad:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        return norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def build_optimizer(
    chunks, config, *, lr: float, weight_decay: float, clip_grad: float, pg, min_lr: float = 0.0
):
    """megatron-core's distributed optimizer on GPU, :class:`CPUOptimizer` on CPU (a
    learning-rate scheduler then sets the rate of every step); their AdamW runs torch's fused
    kernel unless ``MEGATRON_HYBRID_FUSED_STEP=0`` (``training/optimizer_step.py``)."""
    optimizer = _build_optimizer(
        chunks, config, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, pg=pg, min_lr=min_lr
    )
    if fused_step_enabled():
        use_fused_adam(optimizer)
    return optimizer


def _build_optimizer(
    chunks, config, *, lr: float, weight_decay: float, clip_grad: float, pg, min_lr: float
):
    if not torch.cuda.is_available():
        return CPUOptimizer(
            chunks, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, pg_collection=pg
        )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=True,
    )
    return get_megatron_optimizer(optimizer_config, chunks)


@dataclass(frozen=True)
class StepResult:
    """What one step reports (the same on every rank).

    ``finite`` is False when the loss or a gradient was NaN or infinite on some rank; the
    optimizer was then not stepped (the parameters are those before the step), and
    ``nonfinite`` says what was found first (``parameter NAME (rank R)``, ``gradient of NAME
    (rank R)``, ``the loss`` or ``the gradient norm``). ``flops`` are the model FLOPs of the
    global batch (the micro-batches' ``model_flops``, summed over data-parallel ranks; 0 where
    the batches carry none).
    """

    loss: float
    grad_norm: float
    tokens: int
    finite: bool = True
    nonfinite: str | None = None
    flops: float = 0.0


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
) -> StepResult:
    """One optimizer step over ``batches`` (a list of micro-batch dicts, or one list per chunk).

    ``timer`` (a :class:`~megatron_hybrid.training.phases.PhaseTimer`, for benchmarks) times
    the step's phases, waiting for the device around each; without it nothing waits.

    Returns:
        The step's per-token loss, the gradient norm before clipping and the real tokens of the
        global batch.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _configure_hooks(chunks, config, pg_collection, timer)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    per_chunk = batches if isinstance(batches[0], list) else [batches] * len(chunks)
    iterators = [iter(list(b)) for b in per_chunk]
    with phase(timer, "forward-backward"):
        reports = get_forward_backward_func()(
            forward_step_func=lm_forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(per_chunk[0]),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    fused = fused_step_enabled()
    with phase(timer, "guard"):
        stats = _step_statistics(reports, per_chunk[0], pg_collection, device)
        if fused:
            guard = guard_statistics(optimizer, stats[:2])
        else:  # megatron's path: every gradient checked before its optimizer.step()
            grads = (getattr(p, "main_grad", None) for chunk in chunks for p in chunk.parameters())
            finite = all_finite([stats[:2], *grads], pg_collection)
    if fused:
        with phase(timer, "optimizer"):
            apply_step(optimizer, guard, _clip_grad(optimizer))
        # The step's one copy to the host: loss, tokens, FLOPs, norm and the guard's flag.
        norm_and_flag = torch.stack([guard.grad_norm.double(), guard.nonfinite.double()])
        loss_sum, loss_tokens, tokens, flops, grad_norm, flagged = torch.cat(
            [stats, norm_and_flag]
        ).tolist()
        finite = not flagged
    else:
        grad_norm = float("nan")
        if finite:
            with phase(timer, "optimizer"):
                step = optimizer.step()
            grad_norm = step if isinstance(step, float) else float(step[1])
        loss_sum, loss_tokens, tokens, flops = stats.tolist()
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
    )


def _step_statistics(reports, batches, pg_collection, device) -> torch.Tensor:
    """``[loss sum, loss tokens, real tokens, model FLOPs]`` of the global batch, float64 on the
    device (no host read): the last pipeline stage's losses and every rank's micro-batches,
    summed over data-parallel ranks, the losses shared with the other pipeline stages."""
    losses = [report["lm loss"].double().to(device) for report in reports]
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

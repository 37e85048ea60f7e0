"""The optimizer of a training step: megatron-core's on GPUs (distributed for Adam), and on
the CPU, where megatron's distributed optimizer cannot run (its implementation hard-codes CUDA),
a ``torch.optim.AdamW`` (or SGD) over the same main gradients, with the gradient norm computed
over model-parallel shards as megatron computes it. Their AdamW runs torch's fused kernel unless
``MEGATRON_HYBRID_FUSED_STEP=0`` (:mod:`megatron_hybrid.training.optimizer_step`)."""

from __future__ import annotations

import math

import torch

from megatron_hybrid.checkpointing.finite import collective_device
from megatron_hybrid.training.optimizer_step import (
    NormGroup,
    agree_on_separate_groups,
    fused_step_enabled,
    use_fused_adam,
)
from megatron_hybrid.training.shard_copies import cache_shard_copies, cached_shard_copies_enabled

__all__ = [
    "OPTIMIZERS",
    "CPUOptimizer",
    "build_optimizer",
    "check_expert_stages",
    "check_optimizer",
    "distributed_optimizer",
]


#: The optimizers a step can use (megatron-core's ``OptimizerConfig.optimizer`` names).
OPTIMIZERS = ("adam", "sgd")


def check_optimizer(optimizer) -> str:
    """``optimizer`` if it names one of :data:`OPTIMIZERS`, else ValueError saying which exist."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    return optimizer


class CPUOptimizer:
    """AdamW (or plain SGD) over megatron's ``main_grad`` buffers, with global-norm clipping
    (CPU runs). SGD has no momentum, as megatron's is set up here: one step is
    ``w - lr * (grad + weight_decay * w)``."""

    def __init__(
        self,
        chunks,
        *,
        lr: float,
        weight_decay: float,
        clip_grad: float,
        pg_collection,
        optimizer: str = "adam",
    ):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.clip_grad = clip_grad
        self.pg_collection = pg_collection
        if check_optimizer(optimizer) == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=lr, weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)

    def _grad_norm(self) -> float:
        """The global norm of :meth:`norm_groups`, in float64 (the reference step's)."""
        total = 0.0
        for group in self.norm_groups():
            square = torch.zeros(1, dtype=torch.float64)
            for grad in group.norm_grads:
                square += grad.double().pow(2).sum()
            torch.distributed.all_reduce(square, group=group.process_group)
            total += float(square)
        return math.sqrt(total)

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
    chunks,
    config,
    *,
    lr: float,
    weight_decay: float,
    clip_grad: float,
    pg,
    min_lr: float = 0.0,
    optimizer: str = "adam",
    fused: bool | None = None,
):
    """megatron-core's optimizer on GPU (distributed for Adam), :class:`CPUOptimizer` on CPU (a
    learning-rate scheduler then sets the rate of every step); their AdamW runs torch's fused
    kernel where ``fused`` (default: unless ``MEGATRON_HYBRID_FUSED_STEP=0``,
    ``training/optimizer_step.py``), else as megatron builds it.

    ``optimizer`` is ``"adam"`` (train's) or ``"sgd"`` (no momentum: with ``clip_grad=0`` and
    no weight decay one step is ``w - lr * grad``, the check a user can do).
    """
    check_optimizer(optimizer)
    if not torch.cuda.is_available():
        built = CPUOptimizer(
            chunks,
            lr=lr,
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            pg_collection=pg,
            optimizer=optimizer,
        )
    else:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if not distributed_optimizer(optimizer):
            check_expert_stages(chunks, pg.pp, optimizer)

        optimizer_config = OptimizerConfig(
            optimizer=optimizer,
            sgd_momentum=0.0,
            lr=lr,
            min_lr=min_lr,
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed_optimizer(optimizer),
        )
        built = get_megatron_optimizer(optimizer_config, chunks)
        agree_on_separate_groups(built)  # every stage the same collectives, in either step
    if fused is None:
        fused = fused_step_enabled()
    if fused:
        use_fused_adam(built)  # SGD keeps its own step (use_fused_adam says why)
        if torch.cuda.is_available() and cached_shard_copies_enabled():
            cache_shard_copies(built)  # megatron's copies where it copies another way
    return built


def check_expert_stages(chunks, pp_group, optimizer: str) -> None:
    """Refuse megatron-core's non-distributed optimizer where some pipeline stages hold expert
    parameters and others none (one all-gather over ``pp_group``; every stage raises alike).

    That optimizer reduces the expert gradients' statistics over a group of its own that spans
    the stages (``expt_tp_pp``, the dense ones over ``mp``), and megatron-core 0.19.2 builds no
    expert optimizer on a stage without experts: that stage would never join the expert norm's
    all-reduce, and the step would hang. The distributed optimizer (Adam) reduces both over one
    group, which every stage joins.

    Raises:
        ValueError: the stages disagree; says which hold no experts and what to change.
    """
    size = 1 if pp_group is None else torch.distributed.get_world_size(pp_group)
    if size == 1:
        return
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    # A stage may hold no trainable parameter at all (adapters on expert modules only): the
    # flag's device follows the process group's backend, not the parameters.
    held = torch.tensor([int(any(not getattr(p, "allreduce", True) for p in params))],
                        dtype=torch.int32, device=collective_device(pp_group))  # fmt: skip
    stages = [torch.zeros_like(held) for _ in range(size)]
    torch.distributed.all_gather(stages, held, group=pp_group)
    without = [stage for stage, flag in enumerate(stages) if not int(flag)]
    if without and len(without) < size:
        raise ValueError(
            f"optimizer={optimizer!r} runs megatron-core's non-distributed optimizer, which "
            f"reduces the expert gradients' norm over a group spanning the pipeline stages; "
            f"pipeline stage(s) {without} of {size} hold no experts and would never join "
            f"it (the step would hang). Use optimizer='adam' (megatron's distributed optimizer), "
            f"or a layer pattern or pipeline split that puts experts on every stage"
        )


def distributed_optimizer(optimizer: str) -> bool:
    """Whether ``optimizer`` runs as megatron-core's distributed optimizer: Adam on GPUs (its
    sharded states); SGD never (0.19's distributed optimizer asserts on it), nor anything on
    the CPU (:class:`CPUOptimizer`)."""
    return torch.cuda.is_available() and optimizer == "adam"

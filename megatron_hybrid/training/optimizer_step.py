"""``train``'s optimizer step: fused AdamW, one device-side gradient norm, and a non-finite guard
that costs no host synchronisation of its own.

Without TransformerEngine or apex, megatron-core 0.19.2 steps its optimizer the slow way:

* ``optimizer/__init__.py`` falls back to ``torch.optim.AdamW`` with torch's default
  implementation (``foreach``: a dozen multi-tensor kernels per parameter group and step, in
  chunks of tensors);
* ``optimizer/clip_grads.py`` ``get_grad_norm_fp32`` computes the norm through
  ``megatron.core.utils.local_multi_tensor_l2_norm``: one ``torch.norm`` per gradient tensor,
  then ``torch.tensor`` of that list of device scalars, which copies each to the host and waits
  for it (about 550 waits per step at the issue's shape); ``clip_grad_by_total_norm_fp32`` then
  scales through ``local_multi_tensor_scale``, two kernels per tensor;

and ``train``'s guard checked every gradient with kernels of its own before all that.

:func:`guard_statistics` and :func:`apply_step` do the same step with:

* the gradient norm as ``torch._foreach_norm`` over the gradients megatron's optimizer selects
  for it (``get_grads_for_grad_norm``: neither shared nor a tensor-parallel duplicate), squared,
  summed and all-reduced over each optimizer's gradient-statistics group on the device; each
  separate gradient-norm group (megatron's ``SEPARATE_GRAD_NORM_GROUPS``, the MTP depths) gets
  its own norm and clip, as in megatron's ``ChainedOptimizer.step``;
* the division by the step's token count (``finalize_model_grads``) and clipping by
  ``min(1, clip / (norm + 1e-6))`` as one factor computed on the device, applied where the fused
  kernel reads the gradients (its ``grad_scale``, which divides each gradient as it is loaded and
  stores the result back, as ``torch.amp.GradScaler`` uses it): no pass over the gradients of
  their own, where megatron makes two (``scale_gradients``, then ``clip_grad_by_total_norm_fp32``).
  ``train_step`` has :class:`~megatron_hybrid.training.loop.TrainDistributedDataParallel` keep the
  token count's factor instead of multiplying by it; the norm is then the unscaled gradients'
  times that factor (one rounding from megatron's norm of the scaled ones). Where the unscaled
  sums' float32 norm overflows (above about ``1.8e19`` over all of them) the step is flagged, and
  ``train_step`` takes it again in megatron's order. After the step the gradients this rank's
  optimizer updated are scaled and clipped, as megatron leaves them; the rest of a distributed
  optimizer's gradient buffer (other ranks' shards, which nothing reads after the reduce-scatter)
  keeps the unscaled sums. An optimizer
  whose kernel cannot take the factor, or gradients in several norm groups (the MTP depths, each
  clipped on its own), gets it in one ``torch._foreach_mul_`` per group. Without a token factor and
  below the clip the factor is exactly 1: the same gradients bitwise;
* the guard from the numbers the step computes anyway: the step is non-finite when the loss or a
  gradient norm is (a NaN or infinity in any gradient makes its norm NaN or infinite; so does a
  gradient whose square overflows float32, whose norm megatron would report as infinite too);
* AdamW as torch's fused kernel (``fused=True``, :func:`use_fused_adam`) over the same parameter
  groups (the distributed optimizer's float32 main-parameter shards). It takes the non-finite flag
  as its ``found_inf`` and then leaves parameters, moments and step counts as they were, on the
  device: the update waits for nothing. An optimizer that cannot take the flag (not a torch
  Adam/AdamW, or a device or dtype the fused kernel refuses) reads it on the host first, the one
  wait the norm needs.

``train_step`` brings the step's numbers (loss, tokens, norm, flag) to the host in one copy at
the end. ``MEGATRON_HYBRID_FUSED_STEP=0`` restores megatron's own path (its AdamW and
``optimizer.step()``, the per-gradient guard) for comparisons.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_hybrid.checkpointing.finite import collective_device

__all__ = [
    "FUSED_STEP_ENV",
    "GuardStatistics",
    "NormGroup",
    "agree_on_separate_groups",
    "apply_step",
    "fused_step_enabled",
    "grad_square_sum",
    "guard_statistics",
    "norm_groups",
    "sub_optimizers",
    "use_fused_adam",
]

#: ``0`` turns the fused step off (megatron's ``optimizer.step()`` and its AdamW instead).
FUSED_STEP_ENV = "MEGATRON_HYBRID_FUSED_STEP"


def fused_step_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``train`` steps through this module (default) or megatron's own path."""
    return environ.get(FUSED_STEP_ENV, "1") != "0"


def sub_optimizers(optimizer) -> list:
    """The optimizers of a megatron ``ChainedOptimizer`` (none for an empty one), or the
    optimizer itself; stubs (ranks without parameters in them) too."""
    subs = getattr(optimizer, "chained_optimizers", None)
    return [optimizer] if subs is None else list(subs)


def _is_stub(sub) -> bool:
    return getattr(sub, "is_stub_optimizer", False)


def _sub_optimizers(optimizer) -> list:
    """:func:`sub_optimizers` without stubs."""
    return [o for o in sub_optimizers(optimizer) if not _is_stub(o)]


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    return [o.optimizer for o in _sub_optimizers(optimizer) if o.optimizer is not None]


def _fused_reason(inner: torch.optim.Optimizer) -> str | None:
    """Why ``inner`` cannot run torch's fused Adam kernel, or None."""
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(inner).__name__} is not torch's Adam or AdamW"
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for group in inner.param_groups:
        if group.get("differentiable") or group.get("amsgrad"):
            return "differentiable or amsgrad Adam"
        for param in group["params"]:
            if param.device.type not in devices or not param.is_floating_point():
                return f"a {param.dtype} parameter on {param.device.type}"
    return None


def use_fused_adam(optimizer) -> str | None:
    """Switch the torch Adam/AdamW inside ``optimizer`` (megatron's, or ``CPUOptimizer``'s) to
    torch's fused kernel, in place; None, or why an inner optimizer keeps its implementation.

    Step counters that a checkpoint load put on the host are moved to their parameter's device,
    as the fused kernel needs them (each step, by :func:`apply_step`).
    """
    reasons = []
    for inner in _torch_optimizers(optimizer):
        reason = _fused_reason(inner)
        if reason is not None:
            reasons.append(reason)
            continue
        for settings in (inner.defaults, *inner.param_groups):
            settings["fused"], settings["foreach"] = True, False
    return "; ".join(reasons) or None


def _is_fused(inner: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in inner.param_groups)


@dataclass
class NormGroup:
    """Gradients that share one norm and one clip.

    Attributes:
        norm_grads: the gradients the norm sums (each counted once over the model's shards).
        clip_grads: the gradients the clip scales.
        process_group: where the partial sums of squares are all-reduced.
        name: None for the norm ``train`` reports, else the separate gradient-norm group's name
            (megatron's ``SEPARATE_GRAD_NORM_GROUPS``: the MTP depths).
    """

    norm_grads: list[torch.Tensor]
    clip_grads: list[torch.Tensor]
    process_group: object
    name: str | None = None


def _separate_groups_held(optimizer, subs: list) -> dict[int, tuple[str, ...]]:
    """Per gradient-statistics process group of ``subs`` (by ``id``), the separate gradient-norm
    groups (megatron's ``SEPARATE_GRAD_NORM_GROUPS``) some rank of it holds parameters of: one
    MAX all-reduce per process group the first time, cached on ``optimizer`` as megatron caches
    its answer (they are tagged at construction and never change).

    Megatron asks each sub-optimizer (``has_grad_norm_group``, an all-reduce over its group each).
    A pipeline stage whose layers hold no experts has no expert optimizer (megatron-core 0.19.2
    ``optimizer/__init__.py`` builds one only for a non-empty ``moe_param_groups``), so there one
    collective fewer would be made on the group the stages share (the distributed optimizer's,
    dense and expert alike) and the step would hang. Asked once per process group, every rank
    makes the same collectives. A stub (a rank without parameters in that optimizer) joins its
    process group's collectives with nothing, as it joins megatron's norm.
    """
    from megatron.core.optimizer.optimizer import (
        SEPARATE_GRAD_NORM_GROUPS,
        _get_param_grad_norm_group,
    )

    cached = getattr(optimizer, "_separate_groups_held", None)
    if cached is not None:
        return cached
    held: dict[int, tuple[object, list[bool]]] = {}
    for sub in subs:
        process_group = sub.get_grad_stats_parallel_group()
        _, flags = held.setdefault(
            id(process_group), (process_group, [False] * len(SEPARATE_GRAD_NORM_GROUPS))
        )
        if _is_stub(sub):
            continue  # no parameters here, but its process group's collectives all the same
        tags = {_get_param_grad_norm_group(p) for p in sub.get_parameters()}
        for i, name in enumerate(SEPARATE_GRAD_NORM_GROUPS):
            flags[i] = flags[i] or name in tags
    answer = {}
    for key, (process_group, flags) in held.items():
        flag = torch.tensor(flags, dtype=torch.int32, device=collective_device(process_group))
        if flags:
            torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX, group=process_group)
        answer[key] = tuple(
            name for name, on in zip(SEPARATE_GRAD_NORM_GROUPS, flag.tolist(), strict=True) if on
        )
    optimizer._separate_groups_held = answer
    return answer


def agree_on_separate_groups(optimizer) -> None:
    """Settle which separate gradient-norm groups each sub-optimizer of megatron's ``optimizer``
    has (:func:`_separate_groups_held`, the same collectives on every rank) and write the answer
    into megatron's own caches (``has_grad_norm_group``'s ``_has_grad_norm_group_cache``, on each
    sub-optimizer and the chain), so that megatron's step (``MEGATRON_HYBRID_FUSED_STEP=0``)
    asks no further collective either. Call it on every rank, once, after building.
    """
    from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

    subs = sub_optimizers(optimizer)
    held = _separate_groups_held(optimizer, subs)
    for sub in subs:
        names = held[id(sub.get_grad_stats_parallel_group())]
        sub._has_grad_norm_group_cache = {n: n in names for n in SEPARATE_GRAD_NORM_GROUPS}
    if hasattr(optimizer, "chained_optimizers"):
        every = {name for names in held.values() for name in names}
        optimizer._has_grad_norm_group_cache = {n: n in every for n in SEPARATE_GRAD_NORM_GROUPS}


def _megatron_groups(sub, separate: tuple[str, ...]) -> list[NormGroup]:
    """Norm groups of one megatron optimizer, as ``ChainedOptimizer.step`` forms them (a stub's
    empty); ``separate``: the separate gradient-norm groups its process group holds."""
    from megatron.core.optimizer.optimizer import _get_param_grad_norm_group

    process_group = sub.get_grad_stats_parallel_group()
    if _is_stub(sub):
        return [NormGroup([], [], process_group, name) for name in (None, *separate)]
    params = [p for p in sub.get_parameters() if p.grad is not None]
    groups = [
        NormGroup(
            sub.get_grads_for_grad_norm(),
            [p.grad for p in params if _get_param_grad_norm_group(p) is None],
            process_group,
        )
    ]
    for name in separate:
        clip = [p.grad for p in params if _get_param_grad_norm_group(p) == name]
        groups.append(NormGroup(sub.get_grads_for_grad_norm(name), clip, process_group, name))
    return groups


def norm_groups(optimizer) -> list[NormGroup]:
    """The gradient groups of ``optimizer`` after ``prepare_grads()``: megatron's optimizers,
    or an optimizer with a ``norm_groups()`` method (``CPUOptimizer``)."""
    if hasattr(optimizer, "norm_groups"):
        return optimizer.norm_groups()
    subs = sub_optimizers(optimizer)
    held = _separate_groups_held(optimizer, subs)
    return [
        group
        for sub in subs
        for group in _megatron_groups(sub, held[id(sub.get_grad_stats_parallel_group())])
    ]


def grad_square_sum(grads: list[torch.Tensor], device) -> torch.Tensor:
    """``sum(g ** 2)`` over ``grads`` as a float32 device scalar: one ``_foreach_norm`` (one
    kernel per chunk of tensors) and a sum of the squared norms, no host read."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.detach() for g in grads], 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()


@dataclass
class GuardStatistics:
    """What :func:`guard_statistics` found, on the device.

    Attributes:
        groups: the optimizer's :class:`NormGroup` s.
        norms: each group's norm (float32 scalars, all-reduced: the main groups share one).
        grad_norm: the reported norm (the main groups' together).
        nonfinite: True where the loss or a norm is NaN or infinite (bool scalar).
    """

    groups: list[NormGroup]
    norms: list[torch.Tensor]
    grad_norm: torch.Tensor
    nonfinite: torch.Tensor
    scaling: torch.Tensor | None = None

    def norm_and_flag(self) -> torch.Tensor:
        """``[grad_norm, nonfinite]`` in one float64 device tensor, for the step's host copy."""
        return torch.stack([self.grad_norm.double(), self.nonfinite.double()])


def guard_statistics(
    optimizer, loss_totals: torch.Tensor, scaling: torch.Tensor | None = None
) -> GuardStatistics:
    """Prepare the optimizer's gradients, all-reduce their norms, and flag a non-finite step.

    A norm adds its groups' squares over every gradient-statistics process group: partial sums
    of one process group are all-reduced together (one collective per process group), and the
    reduced sums of different process groups are added, as megatron's
    ``ChainedOptimizer.get_grad_norm`` adds the squares of its optimizers' norms.

    Args:
        optimizer: megatron's optimizer or ``CPUOptimizer``.
        loss_totals: the step's loss statistics (already reduced over the ranks that hold them).
        scaling: the factor every gradient still has to be multiplied by (the token count's,
            deferred by ``train_step``; a 0-d device tensor), or None. The norms are those of
            the scaled gradients, and :func:`apply_step` applies it.
    """
    optimizer.prepare_grads()
    groups = norm_groups(optimizer)
    device = loss_totals.device
    partial: dict[tuple[int, str | None], torch.Tensor] = {}
    process_groups: dict[int, object] = {}
    for group in groups:
        key = (id(group.process_group), group.name)
        process_groups[key[0]] = group.process_group
        partial[key] = partial.get(key, 0.0) + grad_square_sum(group.norm_grads, device)
    if scaling is not None:
        # Each rank's sums times its own factor, before the sum over ranks, as megatron scales.
        square = scaling.detach().float().square()
        partial = {key: value * square for key, value in partial.items()}
    totals: dict[str | None, torch.Tensor] = {}
    for pg_id, process_group in process_groups.items():
        names = [name for (pid, name) in partial if pid == pg_id]
        reduced = torch.stack([partial[(pg_id, name)] for name in names])
        torch.distributed.all_reduce(reduced, group=process_group)
        for name, value in zip(names, reduced, strict=True):
            totals[name] = totals[name] + value if name in totals else value
    norms = {name: value.sqrt() for name, value in totals.items()}
    grad_norm = norms.get(None, torch.zeros((), dtype=torch.float32, device=device))
    values = torch.stack(list(norms.values())) if norms else grad_norm.reshape(1)
    finite = torch.isfinite(loss_totals).all() & torch.isfinite(values).all()
    return GuardStatistics(groups, [norms[g.name] for g in groups], grad_norm, ~finite, scaling)


def _steps_to_device(inner: torch.optim.Optimizer) -> None:
    """Move step counters that a checkpoint load left on the host to their parameter's device
    (the fused kernel needs them there); a group whose first counter is there is left alone."""
    for group in inner.param_groups:
        if not group.get("fused"):
            continue
        # Every step: look at the first counter only, the whole group only after a load.
        first = next((p for p in group["params"] if torch.is_tensor(_step_of(inner, p))), None)
        if first is None or _step_of(inner, first).device == first.device:
            continue
        for param in group["params"]:
            step = _step_of(inner, param)
            if torch.is_tensor(step):
                inner.state[param]["step"] = step.to(param.device, torch.float32)


def _step_of(inner: torch.optim.Optimizer, param):
    return inner.state.get(param, {}).get("step")


def _group_factors(stats: GuardStatistics, clip_grad: float) -> list[torch.Tensor | None]:
    """Per norm group, what its gradients are still to be multiplied by (None: nothing): the
    deferred token factor times the clip coefficient, exactly 1 on a flagged step (its gradients
    stay as they are, to name the non-finite one)."""
    factors = []
    for norm in stats.norms:
        factor = stats.scaling.detach().float() if stats.scaling is not None else None
        if clip_grad > 0:
            coefficient = (clip_grad / (norm + 1.0e-6)).clamp(max=1.0)
            factor = coefficient if factor is None else factor * coefficient
        if factor is not None:
            factor = torch.where(stats.nonfinite, 1.0, factor)
        factors.append(factor)
    return factors


def apply_step(optimizer, stats: GuardStatistics, clip_grad: float) -> None:
    """Scale by ``stats.scaling``, clip by ``clip_grad`` (0: no clipping) and step, unless
    ``stats`` flags the step: then nothing the optimizer keeps changes.

    Where every inner optimizer runs torch's fused kernel and every gradient shares one norm,
    the factor goes to the kernel as its ``grad_scale`` (the reciprocal: the kernel divides);
    otherwise each group's gradients are multiplied by their factor first.
    """
    factors = _group_factors(stats, clip_grad)
    inners = _torch_optimizers(optimizer)
    if not all(_is_fused(inner) for inner in inners):
        use_fused_adam(optimizer)  # a checkpoint's param groups may have switched it back
    for inner in inners:
        _steps_to_device(inner)
    fused = all(_is_fused(inner) for inner in inners)
    one_norm = len({group.name for group in stats.groups}) <= 1
    grad_scale = None
    if fused and one_norm and factors and factors[0] is not None:
        grad_scale = 1.0 / factors[0]
    else:
        for group, factor in zip(stats.groups, factors, strict=True):
            if factor is not None and group.clip_grads:
                torch._foreach_mul_(group.clip_grads, factor)
    if not fused:
        if bool(stats.nonfinite):  # the one host read this optimizer needs
            return
        optimizer.step_with_ready_grads()
        return
    found_inf = stats.nonfinite.float()  # a 0-d flag, the shape of the step counters
    for inner in inners:
        inner.found_inf = found_inf  # read by torch's Adam.step, passed to the fused kernel
        if grad_scale is not None:
            inner.grad_scale = grad_scale  # likewise: the kernel divides each gradient by it
    try:
        optimizer.step_with_ready_grads()
    finally:
        for inner in inners:
            del inner.found_inf
            if grad_scale is not None:
                del inner.grad_scale

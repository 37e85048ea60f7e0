"""Pipeline stages whose layers hold no experts: the step's gradient statistics make the same
collectives on every stage (``optimizer_step.norm_groups``), and megatron-core's non-distributed
optimizer, whose expert norm spans the stages, is refused by name (``check_expert_stages``).

megatron-core 0.19.2 builds no expert optimizer on a stage without experts, so such a stage's
``ChainedOptimizer`` has one sub-optimizer where the others have two. The stand-ins below have
the methods of megatron's optimizers that the step calls; their gradient-statistics groups are
the distributed optimizer's, one group for dense and expert alike.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_hybrid.training import optimizer_step
from megatron_hybrid.training.optimizer_step import guard_statistics

MTP = "mtp"  # megatron-core's MTP_GRAD_NORM_GROUP


class Sub:
    """A megatron sub-optimizer's methods that ``norm_groups`` calls."""

    def __init__(self, grads: list[torch.Tensor], group, tags: list[str | None] | None = None):
        self.params = []
        for grad, tag in zip(grads, tags or [None] * len(grads), strict=True):
            param = torch.nn.Parameter(torch.zeros_like(grad))
            param.grad = grad
            if tag is not None:
                param.grad_norm_group = tag  # megatron's GRAD_NORM_GROUP_ATTR
            self.params.append(param)
        self.group = group

    def get_grad_stats_parallel_group(self):
        return self.group

    def get_parameters(self):
        return self.params

    def get_grads_for_grad_norm(self, name=None):
        return [p.grad for p in self.params if getattr(p, "grad_norm_group", None) == name]

    def has_grad_norm_group(self, name):
        """Megatron's: one MAX all-reduce over this optimizer's group (the per-sub question)."""
        local = any(getattr(p, "grad_norm_group", None) == name for p in self.params)
        flag = torch.tensor([int(local)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


class Stub(Sub):
    """megatron's stub: a sub-optimizer of a rank without parameters in it (no torch
    optimizer inside, so no parameters to ask for), its process group set all the same."""

    is_stub_optimizer = True

    def __init__(self, group):
        super().__init__([], group)

    def get_parameters(self):
        raise AssertionError("a stub has no optimizer to take parameters from")


class Chained:
    """megatron's ``ChainedOptimizer``, as far as the step reads it."""

    def __init__(self, subs: list[Sub]):
        self.chained_optimizers = subs

    def prepare_grads(self) -> bool:
        return False


def _stage(rank: int, experts: bool, mtp_on: int | None, group, stub: bool = False) -> Chained:
    """Rank ``rank``'s optimizer: dense gradients (an MTP one where ``mtp_on == rank``) and,
    where ``experts``, an expert optimizer of its own, as megatron builds them (else a stub
    where ``stub``)."""
    gen = torch.Generator().manual_seed(rank)
    dense = [torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen)]
    tags = [None, MTP if mtp_on == rank else None]
    subs = [Sub(dense, group, tags)]
    if experts:
        subs.append(Sub([torch.randn(4, 4, generator=gen)], group))
    elif stub:
        subs.append(Stub(group))
    return Chained(subs)


def _squares(optimizer: Chained, name: str | None) -> float:
    subs = [sub for sub in optimizer.chained_optimizers if not isinstance(sub, Stub)]
    grads = [g for sub in subs for g in sub.get_grads_for_grad_norm(name)]
    return sum(float(g.double().square().sum()) for g in grads)


def stage_worker(rank: int, world_size: int, mtp_on: int | None, stub: bool) -> list[float]:
    """Stage 0 holds experts, stage 1 none: the guard's norms over both, no hang."""
    group = torch.distributed.group.WORLD
    optimizer = _stage(rank, rank == 0, mtp_on, group, stub)
    stats = guard_statistics(optimizer, torch.zeros(2, dtype=torch.float64))
    norms = {g.name: float(n) for g, n in zip(stats.groups, stats.norms, strict=True)}
    expected = {}
    for name in (None, MTP) if mtp_on is not None else (None,):
        total = torch.tensor([_squares(optimizer, name)], dtype=torch.float64)
        torch.distributed.all_reduce(total, group=group)
        expected[name] = math.sqrt(float(total))
    assert set(norms) == set(expected), (norms, expected)
    return [norms[None], expected[None], norms.get(MTP, 0.0), expected.get(MTP, 0.0)]


@pytest.mark.parametrize("stub", [False, True], ids=["no-expert-optimizer", "stub"])
@pytest.mark.parametrize("mtp_on", [None, 0, 1], ids=["no-mtp", "mtp-on-the-expert-stage",
                                                      "mtp-on-the-dense-stage"])  # fmt: skip
def test_a_stage_without_experts_joins_the_same_collectives(mtp_on, stub):
    """Two gloo ranks as two pipeline stages, experts on stage 0 only (stage 1 without an
    expert optimizer, or with a stub): the guard completes on both, with the norm of every
    gradient of both stages (and the MTP group's apart)."""
    from megatron_hybrid.testing.spawn import run_distributed

    for ours, expected, ours_mtp, expected_mtp in run_distributed(stage_worker, 2, mtp_on, stub,
                                                                  timeout=120):  # fmt: skip
        assert ours == pytest.approx(expected, rel=1e-6)
        assert ours_mtp == pytest.approx(expected_mtp, rel=1e-6)


def _collectives(monkeypatch, optimizer: Chained) -> list[tuple]:
    """The all-reduces the guard makes for ``optimizer``, recorded instead of made (group,
    dtype, element count, op), in order."""
    made = []

    def record(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        made.append((group, tensor.dtype, tensor.numel(), str(op)))

    monkeypatch.setattr(torch.distributed, "all_reduce", record)
    # The groups here are stand-ins with no backend to place the flag by.
    monkeypatch.setattr(optimizer_step, "collective_device", lambda group=None: "cpu")
    guard_statistics(optimizer, torch.zeros(2, dtype=torch.float64))
    return made


def _per_sub_question(optimizer, subs):
    """The deliberate bug: each sub-optimizer with parameters asked on its own, as megatron
    asks."""
    held = {id(sub.get_grad_stats_parallel_group()): () for sub in subs}
    for sub in subs:
        if isinstance(sub, Stub):
            continue
        names = tuple(name for name in (MTP,) if sub.has_grad_norm_group(name))
        held[id(sub.get_grad_stats_parallel_group())] = names
    return held


@pytest.mark.parametrize("stub", [False, True], ids=["no-expert-optimizer", "stub"])
@pytest.mark.parametrize("bug", [False, True], ids=["ours", "control-asked-per-sub"])
def test_every_stage_makes_the_same_collectives(monkeypatch, bug, stub):
    """The collectives of a stage with experts and of one without are the same list (a stage
    making one more would wait for ever on the shared group). Control: the separate groups asked
    per sub-optimizer, as megatron's ``has_grad_norm_group`` is, give the expert stage one more."""
    if bug:
        monkeypatch.setattr(optimizer_step, "_separate_groups_held", _per_sub_question)
    group = object()  # the distributed optimizer's one group
    with_experts = _collectives(monkeypatch, _stage(0, True, None, group))
    without = _collectives(monkeypatch, _stage(1, False, None, group, stub))
    assert all(made[0] is group for made in with_experts + without)
    assert (with_experts == without) != bug, (with_experts, without)
    if not bug:
        assert len(with_experts) == 2  # the separate groups' flag once, the norm's partial sums


def expert_stages_worker(rank: int, world_size: int, experts_on: list[int],
                         frozen: bool) -> str | None:  # fmt: skip
    from megatron_hybrid.training.optimizers import check_expert_stages

    chunk = torch.nn.Linear(2, 2)
    if rank in experts_on:
        chunk.weight.allreduce = False  # how megatron marks an expert parameter
    elif frozen:
        chunk.requires_grad_(False)  # a stage with nothing to train (adapters on experts only)
    try:
        check_expert_stages([chunk], torch.distributed.group.WORLD, "sgd")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    ("experts_on", "frozen", "refused"),
    [([0, 1], False, False), ([], False, False), ([0], False, True), ([0], True, True)],
    ids=["experts-on-every-stage", "no-experts", "stage-1-without-experts",
         "stage-1-without-trainable-parameters"],
)  # fmt: skip
def test_non_distributed_optimizer_refuses_stages_without_experts(experts_on, frozen, refused):
    """megatron's non-distributed optimizer (SGD on GPUs) reduces the expert norm over a group
    spanning the stages, which a stage without experts never joins: every stage refuses alike,
    naming the stages and what to change; stages that agree pass."""
    from megatron_hybrid.testing.spawn import run_distributed

    errors = run_distributed(expert_stages_worker, 2, experts_on, frozen, timeout=120)
    if not refused:
        assert errors == [None, None]
        return
    assert errors[0] == errors[1]
    assert "pipeline stage(s) [1] of 2 hold no experts" in errors[0]
    assert "Use optimizer='adam'" in errors[0]


def test_megatrons_own_step_asks_nothing_more_after_the_agreement(monkeypatch):
    """``agree_on_separate_groups`` (``build_optimizer`` calls it) writes the agreed answer into
    megatron's own ``has_grad_norm_group`` caches, so megatron's step
    (``MEGATRON_HYBRID_FUSED_STEP=0``) makes no per-sub collective a stage without experts
    would miss. Control: megatron's question without the agreement makes one per sub."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

    from megatron_hybrid.training.optimizer_step import agree_on_separate_groups

    made = []
    monkeypatch.setattr(
        torch.distributed,
        "all_reduce",
        lambda tensor, op=None, group=None, async_op=False: made.append(group),
    )
    real_tensor = torch.tensor  # megatron makes its flag on "cuda"; this is a CPU
    monkeypatch.setattr(torch, "tensor", lambda *a, device=None, **k: real_tensor(*a, **k))
    monkeypatch.setattr(optimizer_step, "collective_device", lambda group=None: "cpu")
    group = object()
    agreed, fresh = _stage(0, True, 0, group), _stage(0, True, 0, group)
    agree_on_separate_groups(agreed)
    assert made == [group]  # one flag all-reduce for the one process group
    made.clear()
    answers = [MegatronOptimizer.has_grad_norm_group(sub, MTP)
               for sub in agreed.chained_optimizers]  # fmt: skip
    assert answers == [True, True] and ChainedOptimizer.has_grad_norm_group(agreed, MTP)
    assert made == []
    for sub in fresh.chained_optimizers:
        MegatronOptimizer.has_grad_norm_group(sub, MTP)
    assert made == [group, group]

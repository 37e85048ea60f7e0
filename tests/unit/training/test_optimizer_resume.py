"""Adam's step after a distributed-optimizer load (megatron-core 0.19.2 without apex / TE).

``DistributedOptimizer.load_state_dict`` leaves one ``step`` tensor shared by every parameter,
holding a wrong value, while the param groups carry the right step. The distributed optimizer
needs CUDA, so the state it leaves behind is recreated here on a torch Adam, and the restored
optimizer must then step exactly like one that was never interrupted.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from megatron_hybrid.training.checkpoint import _restore_adam_steps


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (5, 3, 7)]


def _step(optimizer, params, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_restored_steps_match_uninterrupted_adam(foreach):
    params = _params(0)
    adam = torch.optim.Adam(params, lr=1e-2, foreach=foreach)
    for s in range(4):
        _step(adam, params, s)

    # The loaded state as megatron leaves it: right moments, one shared wrong step tensor, the
    # right step in the param group.
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = torch.optim.Adam(resumed_params, lr=1e-2, foreach=foreach)
    shared = torch.tensor(1.0)
    for old, new in zip(params, resumed_params, strict=True):
        resumed.state[new] = {**copy.deepcopy(adam.state[old]), "step": shared}
    resumed.param_groups[0]["step"] = 4.0
    _restore_adam_steps(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(
        optimizer=resumed)]))  # fmt: skip

    steps = [resumed.state[p]["step"] for p in resumed_params]
    assert len({id(t) for t in steps}) == len(steps)
    assert all(t.item() == 4.0 for t in steps)
    for s in range(4, 7):
        _step(adam, params, s)
        _step(resumed, resumed_params, s)
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a, b)


def test_without_the_fix_the_shared_step_diverges():
    """The reference above can fail: the unrepaired state steps differently."""
    params = _params(0)
    adam = torch.optim.Adam(params, lr=1e-2)
    for s in range(4):
        _step(adam, params, s)
    broken_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    broken = torch.optim.Adam(broken_params, lr=1e-2)
    shared = torch.tensor(1.0)
    for old, new in zip(params, broken_params, strict=True):
        broken.state[new] = {**copy.deepcopy(adam.state[old]), "step": shared}
    _step(adam, params, 4)
    _step(broken, broken_params, 4)
    assert not all(torch.equal(a, b) for a, b in zip(params, broken_params, strict=True))


def test_optimizers_without_group_step_are_left_alone():
    params = _params(1)
    adam = torch.optim.Adam(params, lr=1e-2)
    _step(adam, params, 0)
    before = {id(p): adam.state[p]["step"] for p in params}
    _restore_adam_steps(types.SimpleNamespace(optimizer=adam))
    assert all(adam.state[p]["step"] is before[id(p)] for p in params)

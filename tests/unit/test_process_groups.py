"""Setting up and tearing down megatron-core's parallel state on a one-rank gloo world."""

from __future__ import annotations

import sys

import pytest

from megatron_hybrid.process_groups import (
    _TE_FP8_MODULES,
    _registered_groups,
    reset_megatron_state,
)


def _registered() -> int:
    return len(_registered_groups())


def test_reset_destroys_the_groups_a_layout_made(model_parallel):
    """Each layout's groups go with the reset: a process that sets up hundreds of layouts (this
    test suite) would otherwise keep every gloo group and its threads."""
    reset_megatron_state()
    baseline = _registered()
    for _ in range(3):
        model_parallel()
        assert _registered() > baseline  # the layout made groups
        reset_megatron_state()
        assert _registered() == baseline


def test_reset_keeps_groups_it_did_not_make(model_parallel):
    import torch
    import torch.distributed as dist

    mine = dist.new_group([0], backend="gloo")
    model_parallel()
    reset_megatron_state()
    value = torch.ones(1)
    dist.all_reduce(value, group=mine)  # still usable
    assert value.item() == 1.0
    dist.destroy_process_group(mine)


def test_reset_forgets_the_expert_dispatch_buffers(model_parallel):
    """DeepEP's and HybridEP's buffers hold a group the reset destroys; megatron-core reuses a
    HybridEP buffer whatever group asks next, so a buffer left behind would serve a new layout
    over a destroyed group."""
    from megatron.core.transformer.moe import fused_a2a

    model_parallel()
    fused_a2a._hybrid_ep_buffer = fused_a2a._buffer = object()  # stand-ins for the buffers
    reset_megatron_state()
    assert fused_a2a._hybrid_ep_buffer is None and fused_a2a._buffer is None


class _FP8State:
    """A stand-in of TransformerEngine's ``FP8GlobalStateManager``: an amax-reduction group
    remembered from an earlier FP8 autocast until ``reset``."""

    groups: list = []

    @classmethod
    def reset(cls):
        cls.groups = []


@pytest.mark.parametrize("module", list(_TE_FP8_MODULES), ids=["te-2.x", "te-fp8-module"])
def test_reset_forgets_transformer_engine_fp8_groups(model_parallel, monkeypatch, module):
    """TE reduces the amaxes over every group it has seen when an FP8 autocast ends; after the
    reset destroyed a layout's groups, that state would make the next FP8 step call a
    destroyed group (seen on 2 GPUs: "not initialized in the world group map")."""
    import types

    te = types.ModuleType(module)
    te.FP8GlobalStateManager = _FP8State
    for name in _TE_FP8_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, module, te)
    pg = model_parallel()
    _FP8State.groups = [pg.tp]
    reset_megatron_state()
    assert _FP8State.groups == []


def test_reset_imports_no_transformer_engine(model_parallel, monkeypatch):
    for name in _TE_FP8_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    model_parallel()
    reset_megatron_state()
    assert not any(name in sys.modules for name in _TE_FP8_MODULES)

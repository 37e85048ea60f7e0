"""Setting up and tearing down megatron-core's parallel state on a one-rank gloo world."""

from __future__ import annotations

from megatron_hybrid.process_groups import _registered_groups, reset_megatron_state


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

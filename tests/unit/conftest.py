"""Shared fixtures: megatron-core on CPU (gloo, CPU emulation) with its global state reset."""

from __future__ import annotations

import os

import pytest

# The unit suite computes on the CPU (gloo ranks, megatron-core's CUDA calls emulated). GPUs are
# hidden before any test module is imported: fla probes the device when it is imported, and a
# process that has initialised CUDA cannot be emulated, so without this the model tests would
# skip on a machine with GPUs instead of running. Spawned ranks inherit the setting.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def megatron_cpu():
    """A one-rank gloo world with megatron-core's CUDA-only calls emulated on CPU.

    Runs on GPU machines too: the CPU back-end makes this process CPU-only. Only a session in
    which CUDA was already used (GPU tests first) skips, because emulation cannot follow it.
    """
    import torch
    import torch.distributed as dist

    from megatron_hybrid.runtime import select_backend
    from megatron_hybrid.testing.spawn import free_port

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is already in use in this process; run tests/unit in its own pytest")
    select_backend("cpu").activate()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    from megatron_hybrid.process_groups import reset_megatron_state

    reset_megatron_state()


@pytest.fixture
def model_parallel(megatron_cpu):
    """Factory: ``model_parallel(tp=1, ...)`` -> ProcessGroupCollection; state reset after."""
    from megatron_hybrid.process_groups import (
        initialize_model_parallel,
        reset_megatron_state,
    )

    yield initialize_model_parallel
    reset_megatron_state()


@pytest.fixture
def pg(model_parallel):
    """Process groups of a single-rank model-parallel setup (fresh megatron state)."""
    return model_parallel()

"""megatron-core's process-global parallel state: set it up, tear it down, start a world.

megatron-core keeps parallel groups, the RNG tracker, the MoE metrics tracker (sized by the
first model's layer count), the aux-loss tracker, the microbatch calculator and the combined-1F1B
streams in module globals. Whoever builds several models in one process (tests, the
``check-checkpoint`` command, benchmarks) must reset them between models, or the second model
silently reuses state sized for the first. The process groups made here are handed to models as
a ``ProcessGroupCollection``; nothing else in the package reads megatron's globals for them.
"""

from __future__ import annotations

import os
import socket
import sys

import torch

__all__ = [
    "free_port",
    "init_single_process_world",
    "init_world",
    "initialize_model_parallel",
    "reset_megatron_state",
]


def free_port() -> int:
    """Return a TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_process_world(backend: str = "gloo") -> None:
    """Start a one-process ``torch.distributed`` world on localhost unless one exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_world() -> tuple[int, int]:
    """Join the job's ``torch.distributed`` world (torchrun), or start a one-process one.

    NCCL with one GPU per process where CUDA is available (the device is ``LOCAL_RANK``), gloo
    otherwise. Does nothing if a world exists.

    Returns:
        ``(rank, world_size)``.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # One process without a launcher: an in-memory store, no port. A port picked free first
        # can be taken by another job before the store listens on it (EADDRINUSE), and a
        # rendezvous address inherited from a parent (a test runner) may be the parent's own.
        alone = {}
        if "WORLD_SIZE" not in os.environ:
            alone = dict(store=dist.HashStore(), rank=0, world_size=1)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, **alone)
    return dist.get_rank(), dist.get_world_size()


# The groups the last initialize_model_parallel made, in creation order. megatron's
# destroy_model_parallel destroys only the groups it created as gloo side groups and forgets the
# rest, which torch.distributed's registry keeps alive: on a gloo world (the CPU) each forgotten
# group keeps its threads, about 60 per layout, so a process that sets up many layouts (the CPU
# test suite, a few hundred) would pile up thousands of threads; on NCCL each keeps its
# communicator's device buffers, outside PyTorch's allocator (2 x H100, 2026-11-28: the GPU
# suite's test processes grew to 25 GiB of such memory each, 2.2 GiB of it PyTorch's, until
# tests failed with CUDA out of memory).
_MADE_GROUPS: list[torch.distributed.ProcessGroup] = []


def _registered_groups() -> list:
    """The process groups torch.distributed knows, in creation order (empty where torch hides
    its registry)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}))


def _destroy_made_groups() -> None:
    """Destroy the groups of :data:`_MADE_GROUPS` that still exist, newest first. Every rank
    resets at the same point of its program, so each destroys the same groups in the same
    order (NCCL's communicator teardown may wait for the group's peers)."""
    import torch.distributed as dist

    registered = set(_registered_groups())
    alive = [group for group in _MADE_GROUPS if group in registered]  # not destroyed by megatron
    if alive and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no collective of theirs may still be in flight
    for group in reversed(alive):
        dist.destroy_process_group(group)
    _MADE_GROUPS.clear()


def reset_megatron_state() -> None:
    """Destroy every piece of megatron-core global state this package's code touches.

    This also destroys the process groups the last :func:`initialize_model_parallel` made (gloo
    and NCCL alike), so models and ``ProcessGroupCollection`` objects from before the reset are
    unusable afterwards (megatron's own globals they rely on are gone too); a gloo group's threads
    end and an NCCL group's device buffers are freed once nothing refers to them any more. Every
    rank of the world must reset at the same point.
    """
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import fused_a2a, moe_logging, moe_utils, token_dispatcher

    parallel_state.destroy_model_parallel()
    _destroy_made_groups()
    # DeepEP's and HybridEP's buffers are bound to a group destroyed above; megatron-core 0.19.2
    # (transformer/moe/fused_a2a.py) reuses a HybridEP buffer whatever group asks next.
    fused_a2a.reset_hybrid_ep_buffer()
    fused_a2a._buffer = None
    moe_logging.destroy_moe_metrics_tracker()
    moe_utils.clear_aux_losses_tracker()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    pp_utils._COMP_STREAM = None
    pp_utils._COMM_STREAM = None
    if hasattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream"):
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    _reset_transformer_engine_fp8()


#: Where TransformerEngine keeps its FP8 global state: 2.x's ``pytorch/quantization.py``, and
#: ``pytorch/fp8.py`` before it moved there.
_TE_FP8_MODULES = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")


def _reset_transformer_engine_fp8() -> None:
    """Forget TransformerEngine's FP8 state, where TE is loaded.

    TE's ``FP8GlobalStateManager`` remembers the amax-reduction group of every FP8 autocast it
    has run and reduces the amaxes of all of them when a later autocast ends (TE 2.20's
    ``quantization.py``): after the groups are destroyed above, the next FP8 step would reduce
    over a destroyed group ("not initialized in the world group map"). Nothing is imported
    here: a process without TE has no such state.
    """
    for name in _TE_FP8_MODULES:
        manager = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
        if manager is not None:
            manager.reset()
            return


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    etp: int | None = None,
    seed: int = 1234,
):
    """Initialise megatron's parallel state and RNG over the default process group.

    The default process group must already exist (``torch.distributed.init_process_group``).

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        vpp: virtual pipeline size (None for no interleaving).
        ep: expert-parallel size.
        cp: context-parallel size.
        etp: expert tensor-parallel size (None: same as ``tp``).
        seed: base seed for ``model_parallel_cuda_manual_seed``.

    Returns:
        A ``ProcessGroupCollection`` of the new groups, to pass to models.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed.init_process_group first"
        )
    reset_megatron_state()
    before = set(_registered_groups())
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    finally:  # also the groups of a setup that failed halfway
        _MADE_GROUPS.extend(group for group in _registered_groups() if group not in before)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()

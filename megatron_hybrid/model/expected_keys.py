"""The checkpoint keys a pattern's model has, without building its weights.

:func:`expected_checkpoint_tensors` builds the model a pattern describes on the ``meta`` device
(no parameter memory, any size) at TP=PP=EP=1 — checkpoint keys and global shapes do not depend
on the parallel layout — and returns its checkpoint keys with global shapes. On a CPU-only
machine the caller chooses the CPU runtime back-end first (megatron-core's model constructors
call CUDA-only functions).
"""

from __future__ import annotations

import contextlib
import dataclasses

from megatron_hybrid.checkpointing.inspect import sharded_tensor_shapes
from megatron_hybrid.model.hybrid_model import HybridModel
from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.pattern import ParsedPattern, parse_pattern
from megatron_hybrid.process_groups import init_single_process_world, initialize_model_parallel

__all__ = ["expected_checkpoint_tensors"]


@contextlib.contextmanager
def _meta_device():
    """Build modules on the meta device: megatron allocates on ``torch.cuda.current_device()``."""
    import torch

    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.cuda.current_device = original


def _single_rank_groups():
    """Process groups of one rank (a one-process gloo world is started if there is none)."""
    import torch.distributed as dist

    init_single_process_world()
    if dist.get_world_size() != 1:
        raise RuntimeError("expected_checkpoint_tensors runs in a single process")
    return initialize_model_parallel()


def expected_checkpoint_tensors(
    config,
    pattern: str | ParsedPattern,
    *,
    vocab_size: int,
    max_sequence_length: int,
    backend: str = "local",
    metadata: dict | None = None,
    **model_kwargs,
) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor of the pattern's model.

    Args:
        config: the model config (any parallel sizes; the model is built unparallelised).
        pattern: the hybrid layer pattern.
        vocab_size: (padded) vocabulary size.
        max_sequence_length: maximum sequence length.
        backend: spec backend.
        metadata: sharded-state-dict metadata (``non_homogeneous_layers``, ...).
        **model_kwargs: further ``HybridModel`` arguments (position embedding type, ...).
    """
    # Keys and global shapes do not depend on the split, so build every layer at once.
    single = parse_pattern(pattern).unsplit
    config = dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        overlap_moe_expert_parallel_comm=False,
        use_cpu_initialization=False,
        perform_initialization=False,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
    )
    pg = _single_rank_groups()
    with _meta_device():
        model = HybridModel(
            config,
            hybrid_stack_spec(backend, config=config),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            hybrid_layer_pattern=single,
            pg_collection=pg,
            **model_kwargs,
        )
        # A copy: megatron adds process groups to the metadata dict it is given.
        sharded = model.sharded_state_dict(metadata=dict(metadata) if metadata else None)
    return sharded_tensor_shapes(sharded)

"""Point-to-point settings of megatron-core's pipeline schedules, the one place that decides them.

Under interleaving (virtual pipeline stages) the settings are Megatron-LM's defaults: overlapped,
unbatched point-to-point communication (``--overlap-p2p-communication``, ``batch_p2p_comm = not
overlap_p2p_comm``). megatron-core's config defaults (batched, not overlapped) put a stage's
forward and backward sends to its neighbours into one batch on one communicator; at pipeline size
2 the neighbour before and after is the same rank, and the two messages, of one shape, are
matched to the wrong receives: the losses stay right and every gradient is wrong as soon as a
step runs more micro-batches than pipeline stages (Megatron-LM refuses interleaving at pipeline
size 2 without the overlap: ``megatron/training/arguments.py``, ``validate_args``). Unbatched
communication sends the two directions over two communicators (megatron-core 0.19.2,
``pipeline_parallel/p2p_communication.py``, ``_p2p_ops``).
"""

from __future__ import annotations

__all__ = ["pipeline_p2p_fields"]


def pipeline_p2p_fields(virtual_pipeline_model_parallel_size: int | None) -> dict:
    """``TransformerConfig`` fields of the pipeline's point-to-point communication."""
    if not virtual_pipeline_model_parallel_size:
        return {}
    return dict(overlap_p2p_comm=True, batch_p2p_comm=False)

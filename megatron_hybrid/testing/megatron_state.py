"""Set up and tear down megatron-core's process-global state for tests and CPU demos.

megatron-core keeps parallel groups, the RNG tracker, the MoE metrics tracker (sized by the
first model's layer count), the aux-loss tracker, the microbatch calculator and the combined-1F1B
streams in module globals. Tests that build several models in one process must reset them
between models, or the second model silently reuses state sized for the first.
"""

from __future__ import annotations

import torch

__all__ = ["initialize_model_parallel", "reset_megatron_state"]


def reset_megatron_state() -> None:
    """Destroy every piece of megatron-core global state this package's code touches."""
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_logging, moe_utils, token_dispatcher

    parallel_state.destroy_model_parallel()
    moe_logging.destroy_moe_metrics_tracker()
    moe_utils.clear_aux_losses_tracker()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    pp_utils._COMP_STREAM = None
    pp_utils._COMM_STREAM = None
    if hasattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream"):
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


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
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()

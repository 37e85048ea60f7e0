"""Combined-1F1B expert-parallel overlap for HybridModel (``build_schedule_plan``), and CUDA
graphs of the layers' compute pieces for both schedules (``hybrid_cuda_graphs``).

:class:`~megatron_hybrid.HybridModel` (one layer up) imports the plan builder from here; the
forward step that megatron-core's schedules call is
:func:`megatron_hybrid.schedule.steps.lm_forward_step`.
"""

from megatron_hybrid.schedule.callables import (
    PRE_LAYER_RUNNERS,
    UnschedulableLayerError,
    build_layer_callables,
    register_pre_layer_runner,
)
from megatron_hybrid.schedule.graphs import (
    CudaGraphReport,
    check_cuda_graph_config,
    disable_cuda_graphs,
    enable_cuda_graphs,
)
from megatron_hybrid.schedule.plan import (
    HybridLayerSchedulePlan,
    HybridModelChunkSchedulePlan,
    build_hybrid_schedule_plan,
    check_schedulable,
)

__all__ = [
    "PRE_LAYER_RUNNERS",
    "CudaGraphReport",
    "HybridLayerSchedulePlan",
    "HybridModelChunkSchedulePlan",
    "UnschedulableLayerError",
    "build_hybrid_schedule_plan",
    "build_layer_callables",
    "check_cuda_graph_config",
    "check_schedulable",
    "disable_cuda_graphs",
    "enable_cuda_graphs",
    "register_pre_layer_runner",
]

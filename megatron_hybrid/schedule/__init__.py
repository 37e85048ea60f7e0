"""Combined-1F1B expert-parallel overlap for HybridModel (``build_schedule_plan``), and CUDA
graphs of the layers' compute pieces for both schedules (``hybrid_cuda_graphs``).

Importing this package registers the plan builder and the graph installer with
:class:`~megatron_hybrid.HybridModel`.
"""

from megatron_hybrid.modules.hybrid_model import (
    set_cuda_graph_installer,
    set_schedule_plan_builder,
)
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

set_schedule_plan_builder(build_hybrid_schedule_plan, check_schedulable)
set_cuda_graph_installer(enable_cuda_graphs)

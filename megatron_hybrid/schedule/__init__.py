"""Combined-1F1B expert-parallel overlap for HybridModel (``build_schedule_plan``).

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
from megatron_hybrid.schedule.plan import (
    HybridLayerSchedulePlan,
    HybridModelChunkSchedulePlan,
    build_hybrid_schedule_plan,
    check_schedulable,
)

__all__ = [
    "PRE_LAYER_RUNNERS",
    "HybridLayerSchedulePlan",
    "HybridModelChunkSchedulePlan",
    "UnschedulableLayerError",
    "build_hybrid_schedule_plan",
    "build_layer_callables",
    "check_schedulable",
    "register_pre_layer_runner",
]

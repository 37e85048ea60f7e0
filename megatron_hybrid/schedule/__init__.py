"""Combined-1F1B expert-parallel overlap for HybridModel (``build_schedule_plan``).

Importing this package registers the plan builder with :class:`~megatron_hybrid.HybridModel`.
"""

from megatron_hybrid.modules.hybrid_model import set_schedule_plan_builder
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

set_schedule_plan_builder(build_hybrid_schedule_plan, check_schedulable)

"""Interleaved pipelines communicate as Megatron-LM's defaults say (``schedule/p2p.py``).

With megatron-core's config defaults, PP 2 x VPP 2 computes wrong gradients from the third
micro-batch on (the forward and backward messages between the two ranks are matched to each
other's receives); ``tests/unit/rl/test_policy_step.py`` steps a PP 2 x VPP 2 model over four
micro-batches against transformers' gradients.
"""

from __future__ import annotations

import pytest

from megatron_hybrid.schedule.p2p import pipeline_p2p_fields


def test_interleaving_overlaps_and_does_not_batch():
    assert pipeline_p2p_fields(None) == {}
    assert pipeline_p2p_fields(2) == dict(overlap_p2p_comm=True, batch_p2p_comm=False)


@pytest.mark.parametrize(
    "pattern, interleaved", [("[*-]|[*-]|[*-]|[*-]", True), ("[*-][*-]|[*-][*-]", False)]
)
def test_train_configs_take_them(pattern, interleaved):
    from megatron_hybrid.runtime.cpu import cpu_config_overrides
    from megatron_hybrid.training.config import config_from_flags

    config = config_from_flags(
        pattern, "--pipeline-model-parallel-size", "2", **cpu_config_overrides()
    )
    assert (config.virtual_pipeline_model_parallel_size is not None) == interleaved
    assert config.overlap_p2p_comm == interleaved
    assert config.batch_p2p_comm == (not interleaved)

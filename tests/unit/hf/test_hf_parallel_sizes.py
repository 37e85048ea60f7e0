"""``load_hf_model`` takes every parallel size ``train`` takes and names what a layout cannot do,
before anything is built (the layouts that run are checked against transformers in
``test_hf_parallel.py`` and, stepped, in ``tests/unit/rl/test_policy_step.py``: PP2 x VPP2)."""

from __future__ import annotations

import hf_oracle
import pytest


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return hf_oracle.make_hf_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("sizes") / "m")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(context_parallel_size=2), r"context_parallel_size=2 needs transformer_impl="),
        (dict(sequence_parallel=True), "sequence_parallel=True needs tensor_model_parallel_size"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=False),
         "sequence_parallel=False .* MoE layers under tensor parallelism only with sequence"),
        (dict(virtual_pipeline_model_parallel_size=2),
         "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1"),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
         r"virtual_pipeline_model_parallel_size=4: .* 4 logical layers, too few for 8"),
        (dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be an int >= 1"),
    ],
    ids=["cp-local", "sp-without-tp", "moe-tp-without-sp", "vpp-without-pp", "vpp-too-deep",
         "etp-0"],
)  # fmt: skip
def test_what_a_layout_cannot_do_is_named(pg, moe_folder, kwargs, match):
    from megatron_hybrid.hf import load_hf_model

    with pytest.raises(ValueError, match="load_hf_model: " + match):
        load_hf_model(moe_folder, **kwargs)


def test_stages_of_a_hugging_face_pattern():
    from megatron_hybrid.pattern import parse_pattern, with_stages

    staged = with_stages("[GE]{3}[*E]", 4)
    assert staged == "[GE]|[GE]|[GE]|[*E]"
    assert parse_pattern(staged).items == parse_pattern("[GE]{3}[*E]").items
    with pytest.raises(ValueError, match="already has '|' stage boundaries"):
        with_stages(staged, 2)

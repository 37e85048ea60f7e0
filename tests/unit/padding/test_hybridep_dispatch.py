"""What the flex dispatcher's hybridep backend receives from our padding, checked on the CPU.

HybridEP itself needs GPUs (``tests/functional/test_hybridep_gpu.py``). Here: ``train``'s flags
give a config that plans the HybridEP term; every plan's per-rank token count passes the checks
DeepEP's hybrid-ep branch makes at run time (modelled below from its source); the micro-batch
builder makes the counts equal across the TP x EP group for padded and packed batches (two gloo
ranks); and the GPU test file skips on a CPU, quickly, saying why.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybrid.padding import bshd_pad, padding_config_from, thd_pack
from megatron_hybrid.testing.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[3]
#: DeepEP 94a9f8f, ``csrc/hybrid_ep/config.cuh``: the dispatch chunk default.
DISPATCH_CHUNK = 64


def hybridep_refuses(tokens: int, ranks: int) -> str | None:
    """DeepEP 94a9f8f's run-time check on a rank's token count (``Executor::
    metadata_preprocess_core``, ``csrc/hybrid_ep/executor/executor.cu``): the last, partial
    dispatch chunk is loaded by TMA as ``remainder x ranks x 4`` bytes, which must be a
    multiple of 16. (Equal counts across the group are required too: the routing maps are
    all-gathered with ``all_gather_into_tensor``.)"""
    remainder = tokens % DISPATCH_CHUNK
    if remainder and remainder * ranks * 4 % 16:
        return f"TMA 16B alignment error: {remainder} x {ranks} x 4 bytes"
    return None


class FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_train_flags_plan_the_hybridep_term():
    """``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep`` reach the
    config ``padding_config_from`` reads; alltoall (negative control) plans no HybridEP term."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hybrid.training.config import config_from_flags

    pg = ProcessGroupCollection(tp=FakeGroup(2), ep=FakeGroup(2), tp_ep=FakeGroup(4))
    flex = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
    common = ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    hybridep = padding_config_from(config_from_flags("[*E]", *common, *flex), pg)
    alltoall = padding_config_from(config_from_flags("[*E]", *common), pg)
    assert (hybridep.hybridep, hybridep.tp_ep, hybridep.sp, hybridep.needs_group_equalize) == (
        True, 4, True, True,
    )  # fmt: skip
    assert not alltoall.hybridep and not alltoall.needs_group_equalize
    assert hybridep.bshd(cur_len=1000, batch_size=2).breakdown["hybridep"] == 128


parallel = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4]),
        "cp": st.sampled_from([1, 2]),
        "sp": st.booleans(),
        "quant": st.sampled_from([None, "delayed", "mxfp8"]),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    cfg=parallel,
    batch_size=st.integers(1, 8),
    lens=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    ranks=st.integers(1, 8),
)
def test_every_plan_passes_hybridep_runtime_checks(cfg, batch_size, lens, ranks):
    cfg = dict(cfg, sp=cfg["sp"] and cfg["tp"] > 1)
    bshd = bshd_pad(cur_len=max(lens), batch_size=batch_size, hybridep=True, **cfg)
    thd = thd_pack(lens, hybridep=True, **cfg)
    for plan in (bshd, thd):
        assert hybridep_refuses(plan.per_rank_tokens, ranks) is None, plan
        assert plan.per_rank_tokens % 128 == 0  # the combine chunk before DeepEP 4214430


@pytest.mark.parametrize("tokens, ranks", [(101, 2), (1, 1), (66, 1)], ids=["odd-2", "1-1", "2-1"])
def test_unplanned_counts_fail_the_check(tokens, ranks):
    """Negative control: the model of DeepEP's check refuses counts our planners never make."""
    assert hybridep_refuses(tokens, ranks).startswith("TMA 16B alignment error")
    assert hybridep_refuses(tokens + DISPATCH_CHUNK - tokens % DISPATCH_CHUNK, ranks) is None


def _builder_worker(rank: int, world_size: int, equalize: bool) -> dict:
    """Each rank builds a micro-batch of different sequences, padded and packed."""
    import torch.distributed as dist

    from megatron_hybrid.data.batches import build_micro_batch
    from megatron_hybrid.data.samples import TokenSample
    from megatron_hybrid.data.synthetic import SyntheticTokens
    from megatron_hybrid.padding import PaddingConfig

    group = dist.new_group(list(range(world_size)))
    padding = PaddingConfig(tp=2, sp=True, hybridep=True, tp_ep=world_size)
    # Rank 1 draws longer sequences: its rows and pack need more tokens.
    data = SyntheticTokens(vocab_size=64, max_length=[100, 700][rank], seed=5)
    out = {}
    samples = [TokenSample(data.sequence(i)) for i in range(3)]
    # train's shape buckets on GPUs (RunInputs._bucketed): each rank's own, from its longest row.
    bucket = -(-max(s.length for s in samples) // BUCKET) * BUCKET
    options = {"bshd": {}, "thd": {"packed": True}, "bshd-bucketed": {"min_length": bucket}}
    for layout, extra in options.items():
        batch = build_micro_batch(
            samples, padding, **{"packed": False, **extra},
            equalize_group=group if equalize else None,
        ).step_inputs()  # fmt: skip
        out[layout] = (batch["input_ids"].numel(), batch["num_tokens"], bucket)
    try:  # A bucket passed as a fixed length: the group cannot lengthen it (the old defect).
        build_micro_batch(samples, padding, packed=False, fixed_length=bucket, equalize_group=group)
    except ValueError as error:
        out["fixed"] = str(error)
    return out


#: Row-length bucket of the builder test, a multiple of the rows' padding multiple (256) as train's
#: are: the two ranks' longest rows (61 and 426 tokens) fall in different buckets.
BUCKET = 256


@pytest.mark.distributed
@pytest.mark.parametrize("equalize", [True, False], ids=["equalized", "control-not-equalized"])
def test_micro_batches_have_equal_counts_across_the_group(equalize):
    """``train``'s builder pads both layouts to the group maximum (HybridEP's all-gather needs
    equal counts); without the group (negative control) the two ranks' counts differ."""
    r0, r1 = run_distributed(_builder_worker, 2, equalize)
    for layout in ("bshd", "thd", "bshd-bucketed"):
        (n0, real0, bucket0), (n1, real1, bucket1) = r0[layout], r1[layout]
        assert real0 < real1, "rank 1's sequences must be longer for this test to mean anything"
        assert (n0 == n1) == equalize, (layout, n0, n1)
        assert n0 % 256 == 0 and n1 % 256 == 0  # chunk 128 x D = tp 2 (SP)
    # Shape buckets are floors: each rank's differs, and the group takes the larger (train on
    # 4 x H200 stopped with "the fixed row length differs across the group" before).
    assert bucket0 < bucket1
    assert r0["bshd-bucketed"][0] == 3 * (bucket1 if equalize else bucket0)
    assert r1["bshd-bucketed"][0] == 3 * bucket1
    for rank in (r0, r1):
        assert "the fixed row length differs across the group" in rank["fixed"]


@pytest.mark.slow
def test_gpu_tests_skip_on_a_cpu():
    """The GPU file collects and skips on a machine without GPUs, saying why, without hanging."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/functional/test_hybridep_gpu.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert " passed" not in output and " failed" not in output, output[-3000:]
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("need CUDA GPUs" in line for line in skipped), output[-3000:]
    assert "13 skipped" in output, output[-3000:]

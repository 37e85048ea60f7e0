"""Padded rows of variable length take few shapes on GPUs (``RunInputs.row_bucket``): every
micro-batch's row length is a multiple of the bucket, at most ``LENGTH_BUCKETS`` lengths up to
the sequence length, within the model's positions; training on bucketed rows trains what the
unbucketed rows train (float32 rounding)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_hybrid.testing.spawn import run_distributed
from megatron_hybrid.training.inputs import LENGTH_BUCKETS, RunInputs, row_length_bucket

FLAGS = ["--hybrid-layer-pattern", "[*E][GE]", "--num-experts", "4", "--swiglu",
         "--train-iters", "3", "--micro-batch-size", "3", "--seq-length", "40",
         "--lr", "1e-3"]  # fmt: skip


@pytest.mark.parametrize(
    ("seq_length", "multiple", "bucket"),
    [(4096, 1, 512), (4096, 8, 512), (4000, 64, 512), (4000, 1, 500), (30, 8, 8), (7, 1, 1),
     (100, 128, 128)],
    ids=["issue-shape", "aligned", "rounded-to-multiple", "unaligned", "short", "tiny",
         "multiple-beyond-length"],
)  # fmt: skip
def test_bucket_is_an_aligned_eighth_of_the_length(seq_length, multiple, bucket):
    assert row_length_bucket(seq_length, multiple) == bucket
    assert bucket % multiple == 0
    assert -(-seq_length // bucket) <= LENGTH_BUCKETS  # at most that many lengths


@pytest.mark.parametrize(
    ("longest", "positions", "width"),
    [(1, None, 512), (512, None, 512), (513, None, 1024), (4000, None, 4096),
     (4000, 4096, 4096), (4000, 4000, None), (3500, 4000, 3584)],
    ids=["one-token", "exact", "next", "top", "top-fits", "top-passes-positions",
         "below-positions"],
)  # fmt: skip
def test_row_length_is_the_bucket_above_the_longest(longest, positions, width):
    inputs = SimpleNamespace(
        row_bucket=512, seq_length=4000, args=SimpleNamespace(max_position_embeddings=positions)
    )
    assert RunInputs._bucketed(inputs, longest) == width


def _worker(rank: int, world_size: int, argv: list[str], bucketed: bool):
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import inputs as inputs_module
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    init, build, widths, buckets = RunInputs.__init__, RunInputs._build, [], []

    def gpu_init(self, *args, on_gpu, **kwargs):
        init(self, *args, on_gpu=bucketed, **kwargs)  # the GPU's layout decision, on the CPU
        buckets.append(self.row_bucket)

    def recording(self, samples):
        batch = build(self, samples)
        widths.append(batch.seq_length)
        return batch

    inputs_module.RunInputs.__init__, inputs_module.RunInputs._build = gpu_init, recording
    try:
        summary = run_training(
            settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
        )
    finally:
        inputs_module.RunInputs.__init__, inputs_module.RunInputs._build = init, build
    return summary.losses, widths, buckets


@pytest.mark.slow
@pytest.mark.distributed
def test_bucketed_rows_train_what_unbucketed_rows_train():
    (plain, plain_widths, none), *_ = run_distributed(_worker, 1, FLAGS, False, timeout=600)
    (bucketed, widths, (bucket,)), *_ = run_distributed(_worker, 1, FLAGS, True, timeout=600)
    assert none == [None] and bucket == row_length_bucket(40, 1) == 5
    # The data's lengths vary: unbucketed widths are no multiples of 5 (the check is not vacuous).
    assert any(w % bucket for w in plain_widths), plain_widths
    assert all(w % bucket == 0 and w <= 40 for w in widths), widths
    assert all(0 <= w - p < bucket for w, p in zip(widths, plain_widths, strict=True))
    assert len(set(widths)) <= LENGTH_BUCKETS
    assert len(bucketed) == len(plain) == 3
    assert bucketed == pytest.approx(plain, rel=1e-5, abs=1e-6)

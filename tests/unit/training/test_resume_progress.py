"""A resume continues from the checkpoint's consumed-sample count and refuses to go backwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_checkpoint_faults import TINY, run_cli


def recording_worker(rank: int, world_size: int, argv: list[str]):
    """``run_training`` that also returns the sample indices of every micro-batch it built."""
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.data.synthetic import SyntheticSamples
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    seen: list[int] = []
    sample = SyntheticSamples.sample

    def recording_sample(self, index):
        seen.append(index)
        return sample(self, index)

    SyntheticSamples.sample = recording_sample
    summary = run_training(
        settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
    )
    return summary, seen


def train(*argv: str):
    from megatron_hybrid.testing.spawn import run_distributed

    ((summary, seen),) = run_distributed(recording_worker, 1, list(argv), timeout=300)
    return summary, seen


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """3 steps of 4 samples (2 micro-batches of 2), saved."""
    root = tmp_path_factory.mktemp("progress") / "ckpt"
    _, seen = train(*TINY, "--global-batch-size", "4", "--train-iters", "3", "--save", str(root))
    assert seen == list(range(12))
    return root


@pytest.mark.slow
def test_resume_with_another_batch_size_continues_from_consumed_samples(first_run, tmp_path):
    from megatron.core import dist_checkpointing

    save = tmp_path / "resumed"
    summary, seen = train(*TINY, "--global-batch-size", "8", "--train-iters", "5",
                          "--load", str(first_run), "--save", str(save))  # fmt: skip
    assert (summary.first_iteration, summary.last_iteration) == (3, 5)
    # Samples 12..27: none skipped (iteration x 8 would start at 24), none repeated.
    assert seen == list(range(12, 28))
    common = dist_checkpointing.load_common_state_dict(str(save / "iter_0000005"))
    assert (common["iteration"], common["consumed_samples"]) == (5, 28)


@pytest.mark.slow
def test_target_below_the_checkpoint_is_refused(first_run):
    result = run_cli("train", *TINY, "--train-iters", "2", "--load", str(first_run))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    message = (
        f"train: error: --train-iters 2 is below iteration 3 of the checkpoint "
        f"{first_run / 'iter_0000003'}; pass --train-iters 3 or more to continue training"
    )
    assert [line for line in result.stderr.splitlines() if "error:" in line][0].endswith(message)
    assert "step" not in result.stdout

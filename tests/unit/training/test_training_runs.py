"""Training runs on CPU, each in fresh processes (megatron-core keeps process-global state).

The loss falls on the default config; a run stopped after a save and resumed gives exactly the
losses of an uninterrupted run; ``--save`` never overwrites unless asked; ``--load`` of a
checkpoint that does not fit fails before training; DP=2 gives DP=1's loss and grad norm.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEFAULT = ["--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4"]


def train_worker(rank: int, world_size: int, argv: list[str]):
    """``run_training`` on the real ``train`` parser's namespace (runs in a spawned rank).

    One intra-op thread: with two, some CPU kernels (the tied embedding's gradient) differ from
    run to run in the last bits, and "exactly the same floats" would be luck. (run_distributed's
    OMP_NUM_THREADS=1 arrives after the child has imported torch, so it is set here.)
    """
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    return run_training(
        settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
    )


def train(*argv: str, world_size: int = 1):
    """Per-rank ``TrainingSummary`` of a run in ``world_size`` fresh gloo processes."""
    from megatron_hybrid.testing.spawn import run_distributed

    return run_distributed(train_worker, world_size, list(argv), timeout=400)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "train", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
def test_loss_falls_on_default_config():
    (summary,) = train(*DEFAULT, "--train-iters", "30")
    losses = summary.losses
    assert (summary.first_iteration, summary.last_iteration, len(losses)) == (0, 30, 30)
    assert all(0 < loss < 10 for loss in losses), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"loss did not fall: first-5 mean {first:.3f}, last-5 {last:.3f}"
    assert all(0 < norm < 100 for norm in summary.grad_norms), summary.grad_norms
    assert summary.tokens_per_second > 0 and summary.saved is None


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """An uninterrupted 12-step run, a 6-step run that saves, and a resume of it to step 12."""
    root = tmp_path_factory.mktemp("resume")
    saved, resumed_save = root / "b", root / "c"
    (full,) = train(*DEFAULT, "--train-iters", "12")
    (first,) = train(*DEFAULT, "--train-iters", "6", "--save", str(saved), "--save-interval", "3")
    tracker = (saved / "latest_checkpointed_iteration.txt").read_text()
    (second,) = train(
        *DEFAULT, "--train-iters", "12", "--load", str(saved), "--save", str(resumed_save)
    )
    return dict(
        full=full, first=first, second=second, saved=saved, tracker=tracker, resumed=resumed_save
    )


@pytest.mark.slow
def test_resume_equals_uninterrupted_run(resumed):
    full, first, second = resumed["full"], resumed["first"], resumed["second"]
    assert len(full.losses) == 12
    assert first.losses == full.losses[:6]  # same start: deterministic
    assert (second.first_iteration, second.last_iteration) == (6, 12)
    assert second.losses == full.losses[6:]  # exactly the same floats
    assert second.grad_norms == full.grad_norms[6:]


@pytest.mark.slow
def test_save_layout(resumed):
    saved = resumed["saved"]
    # The run's metrics and loss curve go beside its checkpoints.
    assert sorted(p.name for p in saved.iterdir()) == [
        "iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt", "loss_curve.png",
        "metrics.jsonl",
    ]  # fmt: skip
    assert resumed["tracker"] == "6"  # the newest, which --load resumed from (not iter 3)
    assert resumed["first"].saved == str(saved / "iter_0000006")
    assert resumed["second"].saved == str(resumed["resumed"] / "iter_0000012")
    assert (resumed["resumed"] / "latest_checkpointed_iteration.txt").read_text() == "12"
    # The buffers' parameter order (training/param_order.py), as the resume read it back.
    from megatron_hybrid.checkpointing.store import read_common

    for folder in (saved / "iter_0000006", resumed["resumed"] / "iter_0000012"):
        assert read_common(folder)["param_order"] == "experts"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        pytest.param(
            "[*E]{3}",
            ["\n  shape of decoder.layers.mlp.router.weight: model (3, 4, 64), "
             "checkpoint (2, 4, 64)\n",
             "\n  shape of decoder.layers.self_attention.linear_proj.weight: model (3, 64, 64), "
             "checkpoint (2, 64, 64)\n"],
            id="more_layers_shape_mismatch",
        ),
        pytest.param(
            "*E*E",  # '[*E]{2}' ungrouped: per-layer keys instead of stacked ones
            ["\n  missing (", "decoder.layers.0.self_attention.linear_proj.weight",
             "\n  unexpected (", "decoder.final_layernorm.weight"],
            id="ungrouped_missing_and_unexpected",
        ),
    ],
)  # fmt: skip
def test_load_of_mismatched_pattern_fails_before_training(resumed, pattern, expected):
    folder = resumed["saved"] / "iter_0000006"
    result = run_cli(
        "--hybrid-layer-pattern", pattern, "--num-experts", "4", "--train-iters", "8",
        "--load", str(resumed["saved"]),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].endswith(f"train: error: --load {folder} does not fit --hybrid-layer-pattern:")
    for text in expected:
        assert text in result.stderr
    assert lines[-1] == "run `python -m megatron_hybrid check-checkpoint` for the full list"
    assert result.stdout == ""  # no "resumed from", no step lines: nothing trained


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overwrite", "code"),
    [pytest.param(False, 2, id="refused"), pytest.param(True, 0, id="overwrite")],
)
def test_save_does_not_overwrite_unless_asked(tmp_path: Path, overwrite, code):
    """``--save`` holding something that is not this run's checkpoints (here a folder that
    only looks complete) is refused before any step; ``--overwrite`` replaces all of it at the
    first save, so nothing of the old contents is mixed with the new."""
    root = tmp_path / "run"
    folder = root / "iter_0000001"
    folder.mkdir(parents=True)
    (folder / "keep.txt").write_text("old")
    (folder / "metadata.json").write_text("{}")  # complete-looking (leftovers are moved)
    flags = ["--overwrite"] if overwrite else []
    result = run_cli(*DEFAULT, "--train-iters", "1", "--save", str(root), *flags)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    tracker = root / "latest_checkpointed_iteration.txt"
    if overwrite:
        assert (folder / "metadata.json").read_text() != "{}" and tracker.read_text() == "1"
        assert not (folder / "keep.txt").exists()  # replaced whole, not mixed
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging left
        lines = result.stdout.splitlines()
        # The start-up line names the device, layout and trainable parameters (all of them
        # without LoRA); the closing line the warm-up apart.
        start = "training [*E]{2} on CPU (1 process, gloo) | TP1 PP1 EP1 CP1 ETP1 DP1 | iterations"
        assert f"{start} 0->1 | parameters 312,448 trainable of 312,448" in lines
        assert f"saved {folder}" in lines[-1] and "no later step to time" in lines[-1]
        assert lines[-1].startswith("done: 1 steps (0->1) | loss ")
    else:
        # Refused at start-up, before any step runs.
        message = f"--save {root} holds a checkpoint that cannot be read"
        assert message in result.stderr and "pass --overwrite to replace" in result.stderr
        assert sum("error:" in line for line in result.stderr.splitlines()) == 1
        assert "step" not in result.stdout
        assert sorted(p.name for p in folder.iterdir()) == ["keep.txt", "metadata.json"]
        assert not tracker.exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_matches_single_rank():
    """DP=2 x 1 micro-batch and DP=1 x 2 micro-batches see one global batch: same loss, norm.

    Megatron's per-token loss with ``finalize_model_grads`` must not scale gradients by the
    data-parallel size (an RL framework once reported a 2x grad norm at DP>1).
    """
    flags = [*DEFAULT, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"]
    dp2 = train(*flags, world_size=2)
    (dp1,) = train(*flags)
    assert dp2[0].losses == dp2[1].losses and dp2[0].grad_norms == dp2[1].grad_norms
    assert len(dp1.losses) == 3
    assert dp2[0].losses == pytest.approx(dp1.losses, rel=1e-5)
    assert dp2[0].grad_norms == pytest.approx(dp1.grad_norms, rel=1e-5)


MAMBA = ["--hybrid-layer-pattern", "(M-M*-){2}", "--seq-length", "32", "--micro-batch-size", "2"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, world_size",
    [
        pytest.param([], 1, id="single"),
        pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, id="tp2_sp"),
        pytest.param(["--pipeline-model-parallel-size", "2"], 2, id="pp2"),
    ],
)
def test_mamba_pattern_trains_on_cpu(tmp_path: Path, layout, world_size):
    """'M' layers train on CPU through the torch Mamba2 path, and their checkpoint saves.

    The save runs megatron-core's ``MambaMixer.sharded_state_dict`` (in_proj split into
    z/x/B/C/dt, conv1d.weight/bias) on the torch mixer's TP shards.
    """
    iters = 12
    summaries = train(*MAMBA, *layout, "--train-iters", str(iters), "--save", str(tmp_path),
                      world_size=world_size)  # fmt: skip
    losses = summaries[-1].losses  # the last pipeline stage computes the loss
    assert len(losses) == iters and all(0 < loss < 10 for loss in losses), losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, f"loss did not fall: first-3 mean {first:.3f}, last-3 {last:.3f}"
    assert (tmp_path / f"iter_{iters:07d}" / "metadata.json").exists()


@pytest.mark.slow
def test_load_with_another_hidden_size_names_the_flag(resumed):
    folder = resumed["saved"] / "iter_0000006"
    result = run_cli(
        "--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4", "--train-iters", "8",
        "--hidden-size", "32", "--ffn-hidden-size", "256", "--load", str(resumed["saved"]),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"python -m megatron_hybrid train: error: --load {folder} does not fit the model: "
        "--hidden-size 32 does not match the checkpoint's 64"
    ]

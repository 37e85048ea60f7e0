"""Faults around ``train`` checkpoints on CPU, each reproduced in fresh processes.

Damaged files are named (exit 2) by ``check-checkpoint`` and ``train --load``; a NaN step stops
the run (or is skipped) and is never saved; a run killed while saving leaves its save root as it
was (the iteration folder is written beside it) and restarts with the same command; no
checkpoint-writer process outlives a killed trainer; a resume continues from the consumed-sample
count, whatever the new batch size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hybrid.training.metrics import read_metrics

TINY = [
    "--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4", "--hidden-size", "32",
    "--num-attention-heads", "2", "--ffn-hidden-size", "64", "--vocab-size", "64",
    "--seq-length", "16", "--micro-batch-size", "2",
]  # fmt: skip
MODEL = TINY[:-4]  # the model-shape flags, for check-checkpoint

# Runs the CLI; SIGKILLs the process when it writes the first byte of a data file whose path
# contains $KILL_AT, after recording the process's children (checkpoint writers) in $CHILDREN.
_KILLING_MAIN = """
import functools, io, json, os, signal, sys
import psutil
from megatron.core.dist_checkpointing.strategies import filesystem_async
write_item = filesystem_async._write_item
@functools.wraps(write_item)  # megatron-core inspects its signature
def killing_write_item(*args, **kwargs):
    stream = next(a for a in args if isinstance(a, io.IOBase))
    if os.environ["KILL_AT"] in str(stream.name):
        stream.write(b"\\0")
        stream.flush()
        children = [p.pid for p in psutil.Process().children(recursive=True)]
        open(os.environ["CHILDREN"], "w").write(json.dumps(children))
        os.kill(os.getpid(), signal.SIGKILL)
    return write_item(*args, **kwargs)
filesystem_async._write_item = killing_write_item
from megatron_hybrid.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(*argv: str, kill_at: str | None = None, children: Path | None = None):
    """``python -m megatron_hybrid ARGV`` in a fresh process (CPU, one thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "megatron_hybrid"]
    if kill_at:
        env.update(KILL_AT=kill_at, CHILDREN=str(children))
        command = [sys.executable, "-c", _KILLING_MAIN]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=300, env=env)


def step_lines(stdout: str) -> dict[int, str]:
    """Step number -> 'loss X | lr L | grad norm Y' of the progress lines."""
    found = re.findall(r"step +(\d+)/\d+ \| (loss \S+ \| lr \S+ \| grad norm \S+)", stdout)
    return {int(step): text for step, text in found}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A save root with iterations 2 and 4 of a tiny run (integrity manifests included)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    result = run_cli("train", *TINY, "--train-iters", "4", "--save", str(root),
                     "--save-interval", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return root


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


_DAMAGES = {
    "bit_flip": lambda d: _flip(d / "__0_0.distcp"),
    "truncated_distcp": lambda d: os.truncate(d / "__0_0.distcp", 1000),
    "deleted_distcp": lambda d: (d / "__0_0.distcp").unlink(),
    "empty_metadata": lambda d: (d / ".metadata").write_bytes(b""),
}
_MESSAGES = {
    "bit_flip": "__0_0.distcp is damaged: its SHA-256 differs from the one recorded",
    "truncated_distcp": "__0_0.distcp is damaged: 1000 bytes, ",
    "deleted_distcp": "__0_0.distcp is missing",
    "empty_metadata": ".metadata is damaged: 0 bytes, ",
    # Without a manifest (older checkpoints): found from the offsets in .metadata.
    "truncated_distcp-no_manifest": "__0_0.distcp is truncated: 1000 bytes, but .metadata records",
    "deleted_distcp-no_manifest": "__0_0.distcp is missing",
    "empty_metadata-no_manifest": ".metadata is damaged or missing (EOFError: ",
    "tracker_abc": "latest_checkpointed_iteration.txt is damaged: it holds 'abc', not an iteration",
}


def damaged_copy(saved: Path, tmp_path: Path, case: str) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    folder = root / "iter_0000004"
    damage, _, variant = case.partition("-")
    if variant == "no_manifest":
        (folder / "integrity.json").unlink()
    if damage == "tracker_abc":
        (root / "latest_checkpointed_iteration.txt").write_text("abc\n")
    else:
        _DAMAGES[damage](folder)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_MESSAGES))
def test_check_checkpoint_names_the_damaged_file(saved, tmp_path, capsys, case):
    from megatron_hybrid.cli.main import main

    root = damaged_copy(saved, tmp_path, case)
    code = main(["check-checkpoint", "--load", str(root), *MODEL])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.splitlines()
    assert line.startswith("python -m megatron_hybrid check-checkpoint: error: ")
    assert _MESSAGES[case] in line and str(root) in line


@pytest.mark.slow
def test_check_checkpoint_verifies_an_intact_checkpoint(saved, capsys):
    """The negative control of the test above: the undamaged original passes."""
    from megatron_hybrid.cli.main import main

    code = main(["check-checkpoint", "--load", str(saved), *MODEL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "files:      match integrity.json" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["bit_flip", "truncated_distcp", "empty_metadata-no_manifest", "tracker_abc"]
)
def test_train_load_names_the_damaged_file(saved, tmp_path, case):
    root = damaged_copy(saved, tmp_path, case)
    result = run_cli("train", *TINY, "--train-iters", "6", "--load", str(root))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and _MESSAGES[case] in errors[0], result.stderr
    assert "step" not in result.stdout  # refused before training


@pytest.mark.slow
def test_nonfinite_step_stops_the_run_and_is_never_saved(tmp_path):
    root = tmp_path / "ckpt"
    result = run_cli("train", *TINY, "--lr", "1e5", "--train-iters", "8", "--save", str(root),
                     "--save-interval", "2")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    # The message names the first non-finite parameter or gradient, not only the loss.
    match = re.search(r"error: step (\d+): (parameter|gradient of) [\w.]+ \(rank 0\) is NaN "
                      r"or infinite \(loss \S+, gradient norm \S+\); stopped without applying or "
                      r"saving it", result.stderr)  # fmt: skip
    assert match, result.stderr
    step = int(match.group(1))
    lines = step_lines(result.stdout)
    assert sorted(lines) == list(range(1, step))  # every step before it ran, none after
    assert all("nan" not in text and "inf" not in text for text in lines.values())
    saved = [int(p.name[len("iter_") :]) for p in root.glob("iter_*")]
    assert step > 2 and sorted(saved) == list(range(2, step, 2))  # only finite steps were saved
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(max(saved))


@pytest.mark.slow
def test_nonfinite_steps_can_be_skipped(tmp_path):
    root = tmp_path / "ckpt"
    result = run_cli("train", *TINY, "--lr", "1e5", "--train-iters", "8", "--save", str(root),
                     "--on-nonfinite", "skip")  # fmt: skip
    assert result.returncode == 0, result.stderr
    skipped = re.findall(r"step (\d+): \S.* is NaN or infinite \(.*\): skipped", result.stdout)
    assert skipped and "8" in skipped
    applied = step_lines(result.stdout)
    assert sorted(applied) + [int(s) for s in skipped] == sorted(range(1, 9))
    # The last step was skipped, the parameters stayed finite: the final save happened.
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "8"


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, str]:
    result = run_cli("train", *TINY, "--train-iters", "10")
    assert result.returncode == 0, result.stderr
    return step_lines(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kill_at", "resumed_from"),
    [pytest.param(5, 0, id="during_first_save"), pytest.param(10, 5, id="during_later_save")],
)
def test_same_command_restarts_after_a_kill_during_a_save(
    tmp_path, uninterrupted, kill_at, resumed_from
):
    """A kill while megatron-core writes the data: the iteration folder was being written beside
    its place (``.iter_*.partial-*``), so the save root holds no half-written iteration folder;
    the same command removes the staging folder and carries on."""
    root = tmp_path / "ckpt"
    argv = ["train", *TINY, "--train-iters", "10", "--save-interval", "5", "--save", str(root),
            "--load", str(root)]  # fmt: skip
    name = f"iter_{kill_at:07d}"
    killed = run_cli(*argv, kill_at=name, children=tmp_path / "children.json")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (staging,) = root.glob(f".{name}.partial-*")
    assert (staging / "__0_0.distcp").stat().st_size == 1
    assert not (root / name).exists()

    restarted = run_cli(*argv)
    assert restarted.returncode == 0, restarted.stderr
    out = restarted.stdout
    assert f"removed {staging} (left by an interrupted write)" in out
    if resumed_from:
        assert f"resumed from {root / 'iter_0000005'} at iteration 5" in out
    else:
        assert f"--load {root} holds no checkpoint yet: starting from scratch" in out
    lines = step_lines(out)
    assert lines == {s: t for s, t in uninterrupted.items() if s > resumed_from}
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt", "loss_curve.png",
        "metrics.jsonl",
    ]  # fmt: skip
    # The run log describes the run that led to the checkpoints: each step once, the killed
    # run's unsaved steps dropped.
    steps = [r["step"] for r in read_metrics(root / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 11))


@pytest.mark.slow
def test_no_checkpoint_writer_outlives_a_killed_trainer(tmp_path):
    children = tmp_path / "children.json"
    killed = run_cli("train", *TINY, "--train-iters", "2", "--save", str(tmp_path / "ckpt"),
                     kill_at="iter_0000002", children=children)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    pids = json.loads(children.read_text())
    for pid in pids:  # the processes megatron-core started: would be orphans now
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert pids == [], f"the trainer had child processes while saving: {pids}"

"""``python -m megatron_hybrid train``: bad input exits 2 with a clear message, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m megatron_hybrid train ARGV`` in a fresh process (CPU, one thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "train", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(
            ["--hybrid-layer-pattern", "[*E]{2", "--num-experts", "4"],
            ["train: error: '{' at position 4 is never closed", "  pattern: '[*E]{2'",
             "                ^"],
            id="bad_pattern_caret",
        ),
        pytest.param(
            ["--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4", "--bogus-flag", "3"],
            ["error: unrecognized arguments: --bogus-flag 3"],
            id="unknown_flag",
        ),
        pytest.param(
            ["--hybrid-layer-pattern", "[*E]{2}"],
            ["train: error: the pattern '[*E]{2}' has MoE ('E') layers; set --num-experts"],
            id="moe_without_num_experts",
        ),
    ],
)  # fmt: skip
def test_bad_input_exits_2(argv, expected):
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    for line in expected:
        assert any(line in got for got in lines), f"{line!r} not in:\n{result.stderr}"
    # One error line (the caret block belongs to it); nothing trained, nothing printed to stdout.
    assert sum("error:" in line for line in lines) == 1, result.stderr
    assert result.stdout == ""


MOE = ["--hybrid-layer-pattern", "[*E]{4}", "--num-experts", "4"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # The three that trained wrongly with exit 0 before.
        pytest.param(MOE + ["--clip-grad", "-1"], "--clip-grad -1.0 must be >= 0", id="clip-grad"),
        pytest.param(MOE + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "-1"],
                     "--recompute-num-layers -1 must be >= 1", id="recompute-num-layers"),
        pytest.param(MOE + ["--moe-router-topk", "0"], "--moe-router-topk 0 must be >= 1",
                     id="topk-zero"),
        # Tracebacks before.
        pytest.param(["--hybrid-layer-pattern", "[*E]{4}", "--num-experts", "3",
                      "--expert-model-parallel-size", "2"],
                     "--expert-model-parallel-size 2 x expert TP 1 x PP 1 = 2 does not divide",
                     id="ep2-one-process"),
        pytest.param(MOE + ["--overlap-moe-expert-parallel-comm"],
                     "needs --expert-model-parallel-size > 1", id="overlap-ep1"),
        pytest.param(["--hybrid-layer-pattern", "[+E]{2}", "--num-experts", "4",
                      "--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim 3 must be even",
                     id="mla"),
        pytest.param(MOE + ["--save", "/proc/ckpt"], "--save /proc/ckpt cannot be written",
                     id="save-unwritable"),
        pytest.param(MOE + ["--micro-batch-size", "-1"], "--micro-batch-size -1 must be >= 1",
                     id="micro-batch-negative"),
    ],
)  # fmt: skip
def test_settings_refused_before_training(argv, expected):
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1, result.stderr  # one message: no upstream warnings either
    assert lines[0].startswith("python -m megatron_hybrid train: error: ") and expected in lines[0]
    assert result.stdout == ""


@pytest.mark.slow
def test_mistyped_flag_suggests_the_closest():
    result = run_cli(*MOE, "--hiden-size", "32")
    assert result.returncode == 2
    assert "usage: python -m megatron_hybrid train" in result.stderr
    assert "unrecognized arguments: --hiden-size 32 (did you mean --hidden-size?)" in result.stderr


@pytest.mark.slow
def test_dash_pattern_hint_gives_the_train_form():
    result = run_cli("--hybrid-layer-pattern", "-*-*")
    assert result.returncode == 2
    assert "--hybrid-layer-pattern='-*-*'" in result.stderr and "describe" not in result.stderr


@pytest.mark.slow
def test_run_is_quiet_and_reports_intermediate_saves(tmp_path):
    """Upstream warnings and megatron's log lines stay hidden; each save prints a line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "PYTHONWARNINGS",
    ):
        env.pop(name, None)
    argv = ["--hybrid-layer-pattern", "*-", "--hidden-size", "32", "--seq-length", "32",
            "--train-iters", "2", "--save", str(tmp_path), "--save-interval", "1"]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "megatron_hybrid", "train", *argv],
                            capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert f"saved {tmp_path / 'iter_0000001'}" in lines
    assert lines[-1].startswith("done: 2 steps") and "async" not in result.stdout
    verbose = subprocess.run([sys.executable, "-m", "megatron_hybrid", "train", *argv,
                              "--overwrite", "--verbose"],
                             capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert verbose.returncode == 0 and "Warning" in verbose.stderr  # negative control

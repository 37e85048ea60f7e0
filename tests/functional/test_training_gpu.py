"""End-to-end training on GPUs: ``python -m megatron_hybrid train`` and Megatron-LM's
``pretrain()`` loop (through :mod:`megatron_hybrid.training.megatron_lm`), each launched with
torchrun, with and without EP overlap; plus save / resume with megatron's distributed optimizer.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.launcher

MODEL = [
    "--hybrid-layer-pattern", "[*E]{4}", "--hidden-size", "256", "--num-attention-heads", "8",
    "--ffn-hidden-size", "512", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear", "--bf16",
    "--transformer-impl", "local", "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "2", "--seed", "1234",
]  # fmt: skip


def _gpus() -> int:
    return torch.cuda.device_count()


def _ep() -> int:
    """EP over as many GPUs as divide the 4 experts (the rest is data parallelism)."""
    return math.gcd(_gpus(), 4)


def _require_ep_overlap() -> None:
    if _ep() < 2:
        pytest.skip(
            f"EP overlap needs EP >= 2, i.e. an even number of GPUs; this host has {_gpus()}"
        )


def _require_megatron_training() -> None:
    if sys.version_info < (3, 12):
        pytest.skip("megatron.training 0.19.2 imports typing.override: needs Python >= 3.12")


def _torchrun(args, env=None, expect: int | None = 0) -> str:
    """Run torchrun; ``expect`` is its exit code (None: any failure)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(_gpus()),
               *args]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})},
        timeout=240, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    ok = result.returncode != 0 if expect is None else result.returncode == expect
    assert ok, output[-6000:]
    return output


def _pretrain(*extra) -> list[float]:
    out = _torchrun([
        "-m", "megatron_hybrid.training.megatron_lm", *MODEL,
        "--expert-model-parallel-size", str(_ep()), "--global-batch-size", str(4 * _gpus()),
        "--train-iters", "20", "--lr", "3e-3", "--lr-decay-style", "constant",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--mock-data",
        "--eval-iters", "0",
        "--eval-interval", "1000",
        "--log-interval", "1", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
        "--use-distributed-optimizer", "--position-embedding-type", "rope",
        "--no-masked-softmax-fusion", *extra,
    ])  # fmt: skip
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]


def test_megatron_lm_pretrain_with_and_without_overlap():
    _require_megatron_training()
    _require_ep_overlap()
    plain = _pretrain()
    overlap = _pretrain("--overlap-moe-expert-parallel-comm")
    print("\npretrain() lm loss (plain):  ", plain)
    print("pretrain() lm loss (overlap):", overlap)
    assert len(plain) == len(overlap) == 20
    assert plain[-1] < plain[0] and overlap[-1] < overlap[0]
    assert overlap[:5] == pytest.approx(plain[:5], rel=5e-3)
    assert overlap == pytest.approx(plain, rel=5e-2)


def _train(*extra, output: list | None = None) -> list[float]:
    ep = str(_ep())
    out = _torchrun(["-m", "megatron_hybrid", "train", *MODEL, "--expert-model-parallel-size", ep,
                     "--global-batch-size", str(4 * _gpus()), *extra])  # fmt: skip
    if output is not None:
        output.append(out)
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", out)]


def test_train_command_with_and_without_overlap():
    _require_ep_overlap()
    plain = _train("--train-iters", "20")
    overlap = _train("--train-iters", "20", "--overlap-moe-expert-parallel-comm")
    print("\ntrain command losses (plain):  ", [round(x, 4) for x in plain])
    print("train command losses (overlap):", [round(x, 4) for x in overlap])
    assert len(plain) == len(overlap) == 20
    # Same numerics per step (tests/functional/test_ep_overlap_gpu.py checks that closely); over
    # 20 Adam steps the bf16 rounding differences grow, so the curves are compared loosely.
    assert overlap[:5] == pytest.approx(plain[:5], rel=5e-3)
    assert overlap == pytest.approx(plain, rel=5e-2)
    assert plain[-1] < plain[0] - 0.5 and overlap[-1] < overlap[0] - 0.5


def test_train_command_resume_equals_uninterrupted(tmp_path):
    output: list[str] = []
    straight = _train("--train-iters", "12", output=output)
    # The start-up line names the GPUs, the closing line times the steps after warm-up.
    name = torch.cuda.get_device_name()
    assert f"on {_gpus()} x {name} (nccl) |" in output[0], output[0][-3000:]
    assert re.search(r"\| median step [0-9.]+ m?s, [0-9,]+ tok/s \| warm-up ", output[0])
    first = _train("--train-iters", "6", "--save", str(tmp_path))
    # The checkpoint (distributed optimizer, NCCL) records its settings: no flag needed.
    check = subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "check-checkpoint", "--load", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert check.returncode == 0 and "OK:" in check.stdout, check.stdout + check.stderr
    resumed = _train("--train-iters", "12", "--load", str(tmp_path))
    print("\nuninterrupted:", straight, "\nfirst half:", first, "\nresumed:", resumed)
    assert first == pytest.approx(straight[:6], rel=1e-6)
    # GPU kernels (atomics in the distributed optimizer's reduce-scatter) are not bitwise
    # reproducible run to run; the resumed curve must follow the uninterrupted one closely.
    assert resumed == pytest.approx(straight[6:], rel=2e-3)


def test_nonfinite_step_is_named_on_gpus(tmp_path):
    """A step whose values blow up stops the run (exit 2) naming the first non-finite
    parameter or gradient; the NaN flags and names cross ranks over NCCL, and nothing
    non-finite is saved."""
    out = _torchrun(["-m", "megatron_hybrid", "train", *MODEL, "--expert-model-parallel-size",
                     str(_ep()), "--global-batch-size", str(4 * _gpus()), "--lr", "1e6",
                     "--train-iters", "12", "--save", str(tmp_path), "--save-interval", "1"],
                    expect=None)  # fmt: skip
    # torchrun reports the failed worker; the worker's own message is the package's: the guard
    # (a non-finite gradient) or the store (a step left a parameter infinite before its save).
    assert re.search(r"error: (step \d+: (parameter|gradient of) [\w.]+ \(rank \d+\) is NaN or "
                     r"infinite|not saving \S+: [\w.]+ has NaN or infinite values \(rank \d+\))",
                     out), out[-4000:]  # fmt: skip

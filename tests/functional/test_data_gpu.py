"""``train --data-path --packed`` on one GPU: a data set ``prepare-data`` writes on the machine
(tokenizer and text built from the package's own files, no download) trains packed into THD
micro-batches of one fixed token budget, evaluates, and its tokens/s stands next to the synthetic
data's on the same model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ON_CPU, Job, launch_all

pytestmark = pytest.mark.launcher

MODEL = [
    "--hybrid-layer-pattern", "[*E]{4}", "--hidden-size", "512", "--num-attention-heads", "8",
    "--ffn-hidden-size", "1024", "--num-experts", "8", "--moe-router-topk", "2",
    "--disable-bias-linear", "--bf16", "--seq-length", "2048", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--train-iters", "30", "--lr", "1e-3", "--log-interval", "5",
    "--packed",
]  # fmt: skip


def _run(*argv: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", *argv], capture_output=True, text=True,
        timeout=900, env={**os.environ}, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    if ON_CPU:  # the data path's logic is the CPU suite's (tests/unit/data); this is GPU speed
        pytest.skip("tokens/s of a GPU-sized model: GPUs only")
    from megatron_hybrid.testing.tokenizers import build_tokenizer, text_rows, write_jsonl

    folder = tmp_path_factory.mktemp("data")
    build_tokenizer(folder / "tokenizer", vocab_size=4096)
    write_jsonl(folder / "corpus.jsonl", text_rows(4000, seed=1, lines_per_row=(5, 60)))
    out = _run("prepare-data", "--input", str(folder / "corpus.jsonl"), "--tokenizer-model",
               str(folder / "tokenizer"), "--output-prefix", str(folder / "corpus"),
               "--append-eod", "--workers", "4")  # fmt: skip
    assert "prepared 4,000 documents" in out
    return folder


def _rate(output: str) -> tuple[float, float]:
    """The closing line's tokens/s and (their product with its median step) tokens per step."""
    seconds, unit, rate = re.findall(r"median step ([0-9.]+) (m?s), ([0-9,]+) tok/s", output)[-1]
    rate = float(rate.replace(",", ""))
    return rate, rate * float(seconds) / (1000.0 if unit == "ms" else 1.0)


@pytest.mark.time_limit(300)  # prepare-data of 4,000 documents, then two train jobs side by side
def test_data_path_trains_packed_at_a_fixed_budget(dataset, tmp_path):
    tokenizer = str(dataset / "tokenizer")
    train = ["-m", "megatron_hybrid", "train", *MODEL, "--tokenizer-model", tokenizer]
    jobs = [
        Job([*train, "--data-path", str(dataset / "corpus_text_document"), "--split", "98,2,0",
             "--eval-interval", "15", "--eval-iters", "2", "--log-dir", str(tmp_path)], 1,
            name="train --data-path"),
        # Its tokens per step only: 10 steps (the last --train-iters counts).
        Job([*train, "--train-iters", "10"], 1, name="train, synthetic data"),
    ]  # fmt: skip
    # Side by side on one GPU (a small model: each job's time goes mostly into starting); the
    # claim is tokens per step, which sharing cannot change.
    data, synthetic = launch_all(jobs, timeout=270, share_gpus=True)
    for name, output in (("--data-path", data), ("synthetic", synthetic)):
        closing = [line for line in output.splitlines() if line.startswith(("done:", "first"))]
        print(f"\n{name}: " + " | ".join(closing))
    assert "packed: THD micro-batches of 4,096 tokens (2 samples, documents apart)" in data
    assert "padded rows" not in data
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", data)]
    # Learning: on 2 x H200 and 1 x H200 (2026-11-27) the logged losses fell from 6.65 to 5.75 in
    # 30 steps, the same to 3 decimals on both (the data and the model are seeded); a run that
    # does not learn stays within 0.1 of its first loss.
    assert losses[-1] < losses[0] - 0.5, losses
    assert len(re.findall(r"validation loss [0-9.]+", data)) >= 2
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "loss_curve.png").exists()
    (ours, ours_step), (theirs, theirs_step) = _rate(data), _rate(synthetic)
    print(f"\ntokens/s on one GPU: --data-path {ours:,.0f} ({ours_step:,.0f} a step), "
          f"synthetic {theirs:,.0f} ({theirs_step:,.0f} a step)")  # fmt: skip
    # A real sample fills the budget (every step 4 micro-batches of 4,096 tokens); a synthetic
    # sequence (8 to 2,048 tokens) about half of it. The claim is the tokens a step carries:
    # their rates are the note's, not this test's, since in the suite the other lanes load the
    # GPU and the cores (one H200, 2026-11-27: 6,217 and 8,932 tokens/s, the data run beside
    # three in-process jobs compiling, the synthetic one after; alone, one after the other,
    # 5,983 and 9,605).
    assert ours_step == pytest.approx(4 * 4096, rel=0.02)
    assert theirs_step < 0.75 * ours_step

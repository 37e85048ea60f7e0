"""``train --data-path`` end to end on a CPU: chat SFT learns the answers and not the prompts,
data written by megatron-core itself trains, a resume is bitwise the uninterrupted run (data
position, learning-rate schedule, evaluation and metrics), also after the data-parallel size
changed, and the metrics files are written."""

from __future__ import annotations

import json
import shutil

import pytest
from data_helpers import chat_rows, prompt_entropy, random_documents, write_indexed

from megatron_hybrid.testing.spawn import run_distributed
from megatron_hybrid.testing.tokenizers import write_jsonl

pytestmark = pytest.mark.slow

MODEL = ["--hybrid-layer-pattern", "[*-]", "--hidden-size", "32", "--num-attention-heads", "2",
         "--ffn-hidden-size", "64"]  # fmt: skip


def _train_worker(rank: int, world_size: int, jobs: list, before=None):
    """``run_training`` of each ``(argv, drop)`` job in turn, in one spawned rank; ``drop`` is a
    negative control's sabotage; ``before(job)`` runs before each job."""
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import run
    from megatron_hybrid.training.train_settings import settings_from_args

    parser, summaries = build_parser(load_commands()), []
    consumed_samples = run.consumed_samples
    for argv, drop in jobs:
        if before is not None:
            before(argv)
        # A resume that restarts the data from sample 0 (the control's sabotage).
        run.consumed_samples = (lambda folder: 0) if drop == "data position" else consumed_samples
        summaries.append(run.run_training(settings_from_args(parser.parse_args(["train", *argv]))))
    return summaries


def train(*argv: str, world_size: int = 1):
    """One run on ``world_size`` spawned ranks; rank 0's summary."""
    jobs = [(list(map(str, argv)), None)]
    return run_distributed(_train_worker, world_size, jobs, timeout=600)[0][0]


def train_runs(*jobs, before=None):
    """Several runs, one after the other in one spawned rank (``(argv, drop)`` each)."""
    jobs = [(list(map(str, argv)), drop) for argv, drop in jobs]
    return run_distributed(_train_worker, 1, jobs, before, timeout=900)[0]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, tokenizer_dir):
    """Chat rows with random prompts and one fixed answer, prepared, and the same tokens
    without their loss mask (the negative control)."""
    from megatron_hybrid.cli.main import main

    folder = tmp_path_factory.mktemp("sft")
    rows = chat_rows(300, seed=7)
    write_jsonl(folder / "chat.jsonl", rows)
    assert main(["prepare-data", "--input", str(folder / "chat.jsonl"), "--output-prefix",
                 str(folder / "sft"), "--tokenizer-model", str(tokenizer_dir), "--json-keys",
                 "messages", "--append-eod"]) == 0  # fmt: skip
    prefix = folder / "sft_messages_document"
    for ext in ("bin", "idx"):
        shutil.copy(f"{prefix}.{ext}", folder / f"unmasked.{ext}")
    return str(prefix), str(folder / "unmasked"), rows


def _prompt_entropy_per_token(rows, prefix) -> float:
    """A floor under the loss over every token: the random prompts' entropy per token of the
    data set (no model predicts uniformly random letters better)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # held: its arrays view a memory map it closes when freed
    return prompt_entropy(rows) / int(dataset.sequence_lengths.sum())


def test_chat_sft_learns_the_answers_not_the_prompts(chat_data, tokenizer_dir, tmp_path):
    masked, unmasked, rows = chat_data
    steps = ["--tokenizer-model", tokenizer_dir, "--seq-length", "64", "--micro-batch-size", "4",
             "--train-iters", "40", "--lr", "1e-2", "--split", "90,10,0", "--eval-interval", "40",
             "--eval-iters", "2", "--log-dir", tmp_path]  # fmt: skip
    floor = _prompt_entropy_per_token(rows, masked)  # about 0.8 nats
    learned, control = train_runs(
        ([*MODEL, "--data-path", masked, *steps], None),
        ([*MODEL, "--data-path", unmasked, *steps[:-2]], None),  # the control: no loss mask
    )
    # The loss counts the answers only; they are fixed, so it falls to about 0 (training and
    # validation), far below what any model can reach on the random prompts ...
    assert learned.losses[0] > 3 and learned.losses[-1] < floor / 4, learned.losses
    assert learned.validation_losses[-1][1] < floor / 4
    # ... while the loss over every token (no mask) keeps the prompts: it stays above the floor.
    assert min(control.losses) > floor, (floor, control.losses)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 41))
    assert (tmp_path / "loss_curve.png").stat().st_size > 0


@pytest.fixture(scope="module")
def megatron_data(tmp_path_factory):
    """A data set written by megatron-core's IndexedDatasetBuilder, not by this package."""
    folder = tmp_path_factory.mktemp("megatron")
    return write_indexed(folder / "corpus", random_documents(400, 500, seed=11, lengths=(5, 60)))


def _resume_flags(data, tokenizer_dir):
    return [*MODEL, "--data-path", data, "--tokenizer-model", tokenizer_dir, "--split", "95,5,0",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--packed", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
            "--lr-decay-iters", "20", "--eval-interval", "5", "--eval-iters", "1"]  # fmt: skip


def _records(folder):
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_second"}
            for line in lines]  # fmt: skip


def _crashed_after_saving(argv: list[str]) -> None:
    """Before the resume: a crashed run logged a step it never saved (it must be dropped)."""
    if "--load" in argv:
        folder = argv[argv.index("--load") + 1]
        with open(f"{folder}/metrics.jsonl", "a") as stream:
            stream.write(json.dumps({"step": 11, "loss": 99.0}) + "\n")


def test_ten_and_ten_steps_are_twenty_bitwise(megatron_data, tokenizer_dir, tmp_path):
    flags = _resume_flags(megatron_data, tokenizer_dir)
    run = tmp_path / "run"
    whole, first, second, control = train_runs(
        ([*flags, "--train-iters", "20", "--log-dir", tmp_path / "whole"], None),
        ([*flags, "--train-iters", "10", "--save", run], None),
        ([*flags, "--train-iters", "20", "--load", run, "--save", run], None),
        # Control: a resume that forgets the data position is not the same run.
        ([*flags, "--train-iters", "20", "--load", run / "iter_0000010"], "data position"),
        before=_crashed_after_saving,
    )
    assert whole.losses[0] > whole.losses[-1]  # it trains on megatron-core's own files
    assert first.losses + second.losses == whole.losses  # bitwise
    assert first.learning_rates + second.learning_rates == whole.learning_rates
    assert first.grad_norms + second.grad_norms == whole.grad_norms
    assert first.validation_losses + second.validation_losses == whole.validation_losses
    assert whole.learning_rates[:4] == pytest.approx([0, 1e-3, 2e-3, 3e-3])  # warm-up
    assert _records(run) == _records(tmp_path / "whole")  # step 11 of the crash is gone
    assert control.losses != whole.losses[10:]


@pytest.mark.distributed
def test_resume_on_another_data_parallel_size(megatron_data, tokenizer_dir, tmp_path):
    """2 ranks (DP2) then 1 rank: the same samples in every global batch, the same losses up
    to the order of the gradient all-reduce (float32)."""
    flags = _resume_flags(megatron_data, tokenizer_dir)
    train(*flags, "--train-iters", "3", "--save", tmp_path / "run", world_size=2)
    whole, second = train_runs(
        ([*flags, "--train-iters", "6"], None),
        ([*flags, "--train-iters", "6", "--load", tmp_path / "run"], None),
    )
    assert second.losses == pytest.approx(whole.losses[3:], rel=1e-5)
    assert second.learning_rates == whole.learning_rates[3:]

"""``train --packed`` packs for real on the CPU and trains exactly what padded rows train.

The same sequences, packed into one THD row per micro-batch or padded into ``[B, S]`` rows, give
the same per-token loss (float32 rounding) and the same update, for a pattern with every symbol
the local backend builds, on one rank and over two pipeline stages (the pipeline sees a
``[1, seq_length x mbs]`` row). The recorded batches show that THD was used, not a fallback.
"""

from __future__ import annotations

import pytest

from megatron_hybrid.testing.spawn import run_distributed

PATTERNS = {1: "[*E][GE][M-][*-]", 2: "[*E][GE]|[M-][*-]"}
FLAGS = ["--num-experts", "4", "--swiglu"]
STEPS = ["--train-iters", "2", "--micro-batch-size", "3", "--seq-length", "24", "--lr", "1e-3"]


def _worker(rank: int, world_size: int, argv: list[str]):
    """``train`` with every micro-batch ``RunInputs`` builds recorded: ``(losses, [(packed,
    real tokens, sequence lengths, the samples' document pieces), ...])``."""
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.inputs import RunInputs
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    seen = []
    build = RunInputs._build

    def recording(self, samples):
        batch = build(self, samples)
        pieces = [list(s.pieces) for s in samples]
        seen.append((batch.packed, batch.num_tokens, batch.sequence_lengths, pieces))
        return batch

    RunInputs._build = recording
    try:
        summary = run_training(
            settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
        )
    finally:
        RunInputs._build = build
    return summary.losses, seen


def _layouts(seen) -> list[str]:
    return sorted({"thd" if packed else "bshd" for packed, *_ in seen})


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
def test_packed_training_equals_padded(pp):
    argv = ["--hybrid-layer-pattern", PATTERNS[pp], *FLAGS, *STEPS]
    argv += ["--pipeline-model-parallel-size", str(pp)]
    (padded, padded_seen), *_ = run_distributed(_worker, pp, argv, timeout=600)
    (packed, packed_seen), *_ = run_distributed(_worker, pp, argv + ["--packed"], timeout=600)
    assert _layouts(padded_seen) == ["bshd"] and _layouts(packed_seen) == ["thd"]
    assert len(packed) == len(padded) == 2
    assert packed == pytest.approx(padded, rel=1e-5, abs=1e-6)


@pytest.mark.distributed
def test_documents_samples_pack_full_rows_of_several_documents():
    """``--synthetic-samples documents --packed``: every micro-batch holds ``micro-batch-size x
    seq-length`` real tokens, and its packed sequences are exactly its samples' documents (more
    than one per sample: each attends only to itself). Control: the default samples leave
    rows part empty, one sequence each."""
    argv = ["--hybrid-layer-pattern", "[*E][*-]", *FLAGS, *STEPS, "--packed"]
    (losses, seen), *_ = run_distributed(
        _worker, 1, argv + ["--synthetic-samples", "documents"], timeout=600
    )
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert seen and all(packed for packed, *_ in seen)
    for _, tokens, lengths, pieces in seen:
        assert tokens == 3 * 24
        assert lengths == [n for sample in pieces for n in sample]
        assert len(lengths) > 3
    (_, plain), *_ = run_distributed(_worker, 1, argv, timeout=600)
    assert all(len(lengths) == 3 for _, _, lengths, _ in plain)
    assert sum(tokens for _, tokens, _, _ in plain) < 3 * 24 * len(plain)

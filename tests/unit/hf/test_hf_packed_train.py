"""``train --load-hf --packed`` packs for every Hugging Face family on a CPU.

Each family's first step, packed into THD rows and padded into ``[B, S]`` rows, sees the same
sequences from the same weights: the losses must agree to float32 rounding, and the recorded
batches must be THD for ``--packed`` (no fallback to padding).
"""

from __future__ import annotations

import pytest
from hf_oracle import CONVERTED

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SHORT = ["--seq-length", "24", "--micro-batch-size", "3", "--train-iters", "1"]


def _worker(rank, world_size, folders):
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.inputs import RunInputs
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    layouts: list[str] = []
    build = RunInputs._build

    def recording(self, samples):
        batch = build(self, samples)
        layouts.append("thd" if batch.packed else "bshd")
        return batch

    RunInputs._build = recording
    parser = build_parser(load_commands())
    out = {}
    for family, folder in folders.items():
        for packed in (False, True):
            layouts.clear()
            argv = ["train", "--load-hf", folder, *SHORT] + (["--packed"] if packed else [])
            summary = run_training(settings_from_args(parser.parse_args(argv)))
            out[family, packed] = (summary.losses, sorted(set(layouts)))
    return out


def test_every_family_trains_packed_as_it_trains_padded(hf_folders):
    folders = {family: str(hf_folders[family][0]) for family in CONVERTED}
    (results,) = run_distributed(_worker, 1, folders, timeout=900)
    for family in CONVERTED:
        padded, padded_layouts = results[family, False]
        packed, packed_layouts = results[family, True]
        assert padded_layouts == ["bshd"] and packed_layouts == ["thd"], family
        assert packed == pytest.approx(padded, rel=1e-5), family

"""Tiny Hugging Face checkpoints with random PEFT adapters, made once per session."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# The Hugging Face oracle lives next door (tests/unit/hf); appended, so that this folder's
# conftest stays the one pytest imports for it.
sys.path.append(str(Path(__file__).resolve().parents[1] / "hf"))

import hf_oracle  # noqa: E402
import peft_oracle  # noqa: E402

SEQ = 24


@dataclass(frozen=True)
class Case:
    """One family's checkpoint, PEFT adapter and PEFT's results on it."""

    family: str
    hf: Path
    adapter: Path
    logits: torch.Tensor
    bound: float
    base_logits: torch.Tensor
    tensors: int
    merged: dict


@pytest.fixture(scope="session")
def input_ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="session")
def cases(tmp_path_factory, input_ids) -> dict[str, Case]:
    """``family -> Case`` for every family (every LoRA tensor random)."""
    root = tmp_path_factory.mktemp("peft")
    out = {}
    for family in peft_oracle.FAMILIES:
        hf = hf_oracle.make_hf_checkpoint(
            family, root / family / "hf", **peft_oracle.overrides(family)
        )
        adapter, logits, bound, count, merged = peft_oracle.make_adapter(
            family, hf, root / family / "adapter", input_ids
        )
        base = hf_oracle.hf_logits(hf, input_ids)
        out[family] = Case(family, hf, adapter, logits, bound, base, count, merged)
    return out

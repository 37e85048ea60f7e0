"""Tiny random Hugging Face folders and transformers' policy-loss gradients, made once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The Hugging Face oracle lives next door (tests/unit/hf); appended, so that this folder's
# conftest stays the one pytest imports for it.
sys.path.append(str(Path(__file__).resolve().parents[1] / "hf"))

import hf_oracle  # noqa: E402
import rl_oracle  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the tiny models' ops gain nothing from a pool, which only adds a
    synchronisation to each (the spawned ranks run with one thread too)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def rl_folders(tmp_path_factory) -> dict:
    """``name -> folder`` of :data:`rl_oracle.FAMILIES`."""
    root = tmp_path_factory.mktemp("rl")
    return {
        name: hf_oracle.make_hf_checkpoint(family, root / name, **overrides)
        for name, (family, overrides) in rl_oracle.FAMILIES.items()
    }


class _Cases(dict):
    """``name -> (batch, {variant name: (loss, gradients)})``, computed on first use."""

    def __init__(self, folders: dict) -> None:
        super().__init__()
        self.folders = folders

    def __missing__(self, name: str):
        folder, family = self.folders[name], rl_oracle.FAMILIES[name][0]
        batch = rl_oracle.make_batch(folder, family)
        oracle = {
            v.name: rl_oracle.transformers_gradients(folder, family, batch, v)
            for v in rl_oracle.VARIANTS
        }
        self[name] = (batch, oracle)
        return self[name]


@pytest.fixture(scope="session")
def rl_cases(rl_folders) -> dict:
    """``name -> (batch, {variant name: (loss, gradients)})``: transformers' side, float32,
    computed for a family when a test first asks for it."""
    return _Cases(rl_folders)

"""``examples/grpo_toy.py``: the whole GRPO loop on a CPU, in this process (its imports shared).

With the seeds fixed the toy task is learned within the 20 steps (full weights: a mean reward of
0.997 over the last five steps on the reference machine, LoRA rank 8: 0.875); the test requires
at least 0.8 (LoRA: 0.7), where any policy that ignores the question gets 0.5 on average, and
the engine's synced weights (merged, with LoRA) to score the last batch as the policy does.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_toy.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_toy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """One torch thread, as the script runs itself on a CPU (tiny ops; see its __main__)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, reward, sync",
    [([], 0.8, 0.0), (["--lora-rank", "8"], 0.7, 1e-5)],
    ids=["full-weights", "lora"],
)
def test_grpo_toy_learns_the_rule(pg, one_thread, tmp_path, flags, reward, sync):
    result = _example().main(["--out", str(tmp_path), "--steps", "20", *flags])
    assert len(result["rewards"]) == 20
    assert result["first"] < 0.7  # it starts near chance
    assert result["last"] >= reward, result["rewards"]
    assert result["sync_error"] <= sync  # merged LoRA weights round differently
    assert json.loads((tmp_path / "rewards.json").read_text())["rewards"] == result["rewards"]
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rewards_and_group_advantages():
    import torch

    example = _example()
    prompts = [torch.tensor([1, q]) for q in (2, 2, 3, 3)]
    answers = [torch.tensor([a]) for a in (40, 10, 40, 10)]  # vocabulary 64: upper half >= 32
    reward = example.rewards(prompts, answers, 64)
    assert reward.tolist() == [1.0, 0.0, 0.0, 1.0]
    advantages = example.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    assert advantages[2:].tolist() == [0.0, 0.0]  # a group that agrees teaches nothing
    assert advantages[0] > 0 > advantages[1]

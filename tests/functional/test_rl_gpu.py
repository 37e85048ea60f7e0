"""``PolicyTrainer`` on GPUs: megatron-core's distributed optimizer steps exactly ``-lr`` times
transformers' gradient (the CPU tests step a torch optimizer over the same gradients).

    torchrun --nproc_per_node 1 -m pytest -q tests/functional/test_rl_gpu.py    # also 2, 4

The folders and transformers' float32 gradients come from ``hf_fixtures.py`` (``rl_<name>``
with ``policy.pt``: the GPU machines have no transformers) through ``MH_HF_FIXTURES``, or are
made here where transformers is importable. Every rank is a data-parallel replica stepping on
its share of the batch (and at 2 or 4 GPUs the MoE family also runs EP = world size), float32
with TF32 off, GatedDeltaNet on megatron's torch path (``deterministic_mode``). The bound is
the CPU tests' (``rl_oracle.bound``: float32's epsilon times the gradient's scale times the
depth, plus the update's rounding); greedy ``sample`` and ``logprobs`` run once on the way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import exact_float32, report

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "unit" / "hf"))
sys.path.insert(0, str(HERE.parent / "unit" / "rl"))

import rl_oracle  # noqa: E402

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")


def _fixtures(shared: str) -> Path:
    root = os.environ.get("MH_HF_FIXTURES")
    if root and (Path(root) / "rl_dense" / "policy.pt").is_file():
        return Path(root)
    try:
        import transformers  # noqa: F401
    except ImportError:
        pytest.skip("no MH_HF_FIXTURES folder with rl_* and no transformers (hf_fixtures.py)")
    import torch.distributed as dist
    from hf_fixtures import rl_main

    if dist.get_rank() == 0:
        rl_main(shared)
    dist.barrier()
    return Path(shared)


@pytest.mark.parametrize("family", list(rl_oracle.FAMILIES))
def test_sgd_step_on_gpu_is_minus_lr_times_transformers_gradient(family, world, shared_dir):
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.rl import PolicyTrainer, sample

    rank, world_size, device = world
    folder = _fixtures(shared_dir) / f"rl_{family}"
    saved = torch.load(folder / "policy.pt", weights_only=False)
    batch = rl_oracle.Batch(**saved["batch"])
    layout = {}
    if family == "moe" and world_size > 1 and 4 % world_size == 0:
        layout = dict(expert_model_parallel_size=world_size)
    reset_megatron_state()
    with exact_float32():
        model = load_hf_model(folder, params_dtype=torch.float32,
                              config_overrides={"deterministic_mode": True}, **layout)  # fmt: skip
        greedy = sample(model, rl_oracle.prompts(), max_new_tokens=4, temperature=0, seed=0)
        trainer = PolicyTrainer(model, optimizer="sgd", lr=rl_oracle.LR, clip_grad=0.0)
        trainer.logprobs(batch.sequences)
        before = {n: t.detach().double().cpu().clone() for n, t in trainer.iter_hf_weights()}
        params = [p for p in model.parameters()]
        start = [p.detach().clone() for p in params]
        dp, dp_rank = trainer.pg.dp.size(), trainer.pg.dp.rank()
        mine = list(range(dp_rank, len(batch.sequences), dp))
        rows = []
        for name, (loss, grads) in saved["oracle"].items():
            variant = next(v for v in rl_oracle.VARIANTS if v.name == name)
            with torch.no_grad():
                for param, value in zip(params, start, strict=True):
                    param.copy_(value)
            metrics = trainer.step(
                [batch.sequences[i] for i in mine], **variant.step_kwargs(batch, mine)
            )
            after = {n: t.detach().double().cpu() for n, t in trainer.iter_hf_weights()}
            moved = {n: (before[n] - after[n]) / rl_oracle.LR for n in before}
            error = rl_oracle.worst_error(moved, grads)
            limit = rl_oracle.bound(grads, before)
            rows.append((name, f"loss {metrics.loss:.6f} vs {loss:.6f}", f"{error:.2e}",
                         f"bound {limit:.2e}"))  # fmt: skip
            assert error <= limit, (family, name, error, limit)
            assert abs(metrics.loss - loss) <= 1e-5 * max(1.0, abs(loss))
    assert all(len(t) == 4 for t in greedy)
    report(f"PolicyTrainer sgd step vs transformers ({family}, {world_size} GPU)", rows)
    reset_megatron_state()

"""Make the Hugging Face folders and reference logits test_hf_gpu.py reads (runs on a CPU).

    python tests/functional/hf_fixtures.py OUT_DIR

The GPU machines have no transformers and no network, so the oracle runs where it can: every
family's tiny randomised checkpoint (tests/unit/hf/hf_oracle.py) goes to ``OUT_DIR/<family>``
with ``reference.pt`` (input ids, transformers' float32 logits, the logits bound of the CPU
tests). The block-scaled FP8 folders (tests/unit/hf/fp8_oracle.py) go to
``OUT_DIR/<family>_fp8``, their ``reference.pt`` holding transformers' logits on the
dequantized weights. Point ``MH_HF_FIXTURES`` at ``OUT_DIR`` on the GPU machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
#: Extra folders: ``name -> (family, config overrides)``. ``nemotron_h_mcore`` has the numerics
#: megatron-core's Mamba kernels compute (a step floor that never binds, gated-norm eps 1e-5),
#: so kernels and transformers can agree on it; the oracle's ``nemotron_h`` clamps the step.
VARIANTS = {"nemotron_h_mcore": ("nemotron_h", {"time_step_min": 1e-4, "layer_norm_epsilon": 1e-5})}
#: FP8 folders: ``name -> (family, scale dtype)`` (DeepSeek-V3 stores float32 scales).
FP8_FOLDERS = {
    "deepseek_v3_fp8": ("deepseek_v3", torch.float32),
    "qwen3_5_moe_fp8": ("qwen3_5_moe", torch.bfloat16),
}


def main(out: str) -> None:
    sys.path.insert(0, str(HERE.parent / "unit" / "hf"))
    import fp8_oracle
    import hf_oracle
    from hf_oracle import CONVERTED, SEQ, logits_bound

    input_ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))
    folders = {family: (family, {}) for family in CONVERTED} | VARIANTS
    for name, (family, overrides) in folders.items():
        folder = hf_oracle.make_hf_checkpoint(family, Path(out) / name, **overrides)
        reference = hf_oracle.hf_logits(folder, input_ids)
        bound = logits_bound(folder, input_ids, reference)
        torch.save(
            {"input_ids": input_ids, "logits": reference, "bound": bound}, folder / "reference.pt"
        )
        print(f"{name}: {folder} (bound {bound:.2e})")
    for name, (family, scale_dtype) in FP8_FOLDERS.items():
        folder = fp8_oracle.make_fp8_folder(
            Path(out) / family, Path(out) / name, scale_dtype=scale_dtype
        )
        values = fp8_oracle.make_dequantized_folder(folder, Path(out) / f"{name}_values")
        reference = hf_oracle.hf_logits(values, input_ids)
        bound = max(1e-3, logits_bound(values, input_ids, reference))
        torch.save(
            {"input_ids": input_ids, "logits": reference, "bound": bound}, folder / "reference.pt"
        )
        print(f"{name}: {folder} (bound {bound:.2e})")
    rl_main(out)


#: The loss variants test_rl_gpu.py checks (indices into ``rl_oracle.VARIANTS``): token-mean
#: alone, and the sequence mean with old/reference log-probs, KL and entropy.
RL_VARIANTS = (0, 3)


def rl_main(out: str) -> None:
    """``OUT/rl_<name>``: each policy-step family's folder and ``policy.pt``."""
    sys.path.insert(0, str(HERE.parent / "unit" / "hf"))
    sys.path.insert(0, str(HERE.parent / "unit" / "rl"))
    import hf_oracle
    import rl_oracle

    for name, (family, overrides) in rl_oracle.FAMILIES.items():
        folder = hf_oracle.make_hf_checkpoint(family, Path(out) / f"rl_{name}", **overrides)
        batch = rl_oracle.make_batch(folder, family)
        variants = [rl_oracle.VARIANTS[i] for i in RL_VARIANTS]
        oracle = {
            v.name: rl_oracle.transformers_gradients(folder, family, batch, v) for v in variants
        }
        torch.save({"batch": batch.__dict__, "oracle": oracle}, folder / "policy.pt")
        print(f"rl_{name}: {folder}")


if __name__ == "__main__":
    main(sys.argv[1])

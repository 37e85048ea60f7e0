"""Make the Hugging Face folders and reference logits that test_hf_gpu.py and test_hf_fp8_gpu.py
read (runs on the CPU of whatever machine has transformers).

    python tests/functional/hf_fixtures.py OUT_DIR

Every family's tiny randomised checkpoint (tests/unit/hf/hf_oracle.py) goes to
``OUT_DIR/<family>`` with ``reference.pt`` (input ids, transformers' float32 logits, the logits
bound of the CPU tests). The block-scaled FP8 folders (tests/unit/hf/fp8_oracle.py) go to
``OUT_DIR/<family>_fp8``, their ``reference.pt`` holding transformers' logits on the
dequantized weights. The suite runner (run_suite.py) makes them on the GPU machine itself, which
has transformers, while the first tests run; point ``MH_HF_FIXTURES`` at ``OUT_DIR``.

``OUT_DIR`` says how far it got: :data:`MAKING` while being made, then :data:`COMPLETE`, or
:data:`FAILED` holding why (:func:`wait_for` reads them).
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
#: Extra folders: ``name -> (family, config overrides)``. ``nemotron_h_mcore`` has the numerics
#: megatron-core's Mamba kernels compute (a step floor that never binds, gated-norm eps 1e-5),
#: so kernels and transformers can agree on it; the oracle's ``nemotron_h`` clamps the step.
VARIANTS = {
    "nemotron_h_mcore": ("nemotron_h", {"time_step_min": 1e-4, "layer_norm_epsilon": 1e-5}),
    "deepseek_v3_4l": ("deepseek_v3", {"num_hidden_layers": 4}),
}
#: FP8 folders: ``name -> (source folder, scale dtype)`` (DeepSeek-V3 stores float32 scales).
#: ``deepseek_v3_4l`` has four layers, so that its pattern splits into two pipeline stages.
FP8_FOLDERS = {
    "deepseek_v3_fp8": ("deepseek_v3", torch.float32),
    "qwen3_5_moe_fp8": ("qwen3_5_moe", torch.bfloat16),
    "deepseek_v3_4l_fp8": ("deepseek_v3_4l", torch.float32),
}
#: The oldest transformers the oracle runs on: 5.17.0 (the GPU machines' version) and 5.23.0
#: give references every family meets (checked on a CPU with both).
MIN_TRANSFORMERS = (5, 17)
MAKING, COMPLETE, FAILED = ".making", ".complete", ".failed"


def transformers_problem() -> str | None:
    """Why this process cannot make the folders, or None."""
    try:
        import transformers
    except ImportError:
        return "transformers is not importable"
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        return (
            f"transformers {transformers.__version__} is older than the oracle's "
            f"{'.'.join(map(str, MIN_TRANSFORMERS))}"
        )
    return None


def wait_for(root: Path, timeout: float) -> str | None:
    """Wait while ``root`` is being made; None once complete, else why it is not usable."""
    deadline = time.monotonic() + timeout
    while (root / MAKING).exists() and not (root / COMPLETE).exists():
        if (root / FAILED).exists():
            break
        if time.monotonic() > deadline:
            return f"{root} was still being made after {timeout:.0f} s"
        time.sleep(0.5)
    if (root / FAILED).exists():
        return f"making {root} failed: {(root / FAILED).read_text().strip()[-400:]}"
    if not (root / COMPLETE).exists():
        return f"{root} is not a complete fixture folder (no {COMPLETE})"
    return None


def main(out: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    (root / MAKING).touch()
    try:
        problem = transformers_problem()
        if problem:
            raise RuntimeError(problem)
        _make(root)
    except BaseException:
        (root / FAILED).write_text(traceback.format_exc())
        raise
    (root / COMPLETE).touch()


def _make(root: Path) -> None:
    sys.path.insert(0, str(HERE.parent / "unit" / "hf"))
    import fp8_oracle
    import hf_oracle
    from hf_oracle import CONVERTED, SEQ, logits_bound

    input_ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))
    folders = {family: (family, {}) for family in CONVERTED} | VARIANTS
    for name, (family, overrides) in folders.items():
        folder = hf_oracle.make_hf_checkpoint(family, root / name, **overrides)
        reference = hf_oracle.hf_logits(folder, input_ids)
        bound = logits_bound(folder, input_ids, reference)
        torch.save(
            {"input_ids": input_ids, "logits": reference, "bound": bound}, folder / "reference.pt"
        )
        print(f"{name}: {folder} (bound {bound:.2e})", flush=True)
    for name, (source, scale_dtype) in FP8_FOLDERS.items():
        folder = fp8_oracle.make_fp8_folder(root / source, root / name, scale_dtype=scale_dtype)
        values = fp8_oracle.make_dequantized_folder(folder, root / f"{name}_values")
        reference = hf_oracle.hf_logits(values, input_ids)
        bound = max(1e-3, logits_bound(values, input_ids, reference))
        torch.save(
            {"input_ids": input_ids, "logits": reference, "bound": bound}, folder / "reference.pt"
        )
        print(f"{name}: {folder} (bound {bound:.2e})", flush=True)
    rl_main(str(root))


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

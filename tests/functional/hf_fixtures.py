"""Make the Hugging Face folders and reference logits test_hf_gpu.py reads (runs on a CPU).

    python tests/functional/hf_fixtures.py OUT_DIR

The GPU machines have no transformers and no network, so the oracle runs where it can: every
family's tiny randomised checkpoint (tests/unit/hf/hf_oracle.py) goes to ``OUT_DIR/<family>``
with ``reference.pt`` (input ids, transformers' float32 logits, the logits bound of the CPU
tests). Point ``MH_HF_FIXTURES`` at ``OUT_DIR`` on the GPU machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main(out: str) -> None:
    sys.path.insert(0, str(HERE.parent / "unit" / "hf"))
    import hf_oracle
    from hf_oracle import CONVERTED, SEQ, logits_bound

    input_ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))
    for family in CONVERTED:
        folder = hf_oracle.make_hf_checkpoint(family, Path(out) / family)
        reference = hf_oracle.hf_logits(folder, input_ids)
        bound = logits_bound(folder, input_ids, reference)
        torch.save(
            {"input_ids": input_ids, "logits": reference, "bound": bound}, folder / "reference.pt"
        )
        print(f"{family}: {folder} (bound {bound:.2e})")


if __name__ == "__main__":
    main(sys.argv[1])

"""Hugging Face checkpoints in and out (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, DeepSeek-V3).

Needs ``safetensors`` at run time, not transformers. See ``docs/hf_checkpoints.md``.

* :func:`load_hf_model` builds the model a Hugging Face folder describes, on any TP/EP/PP
  layout, and loads its weights strictly;
* :func:`conversion_for` (config.json -> TransformerConfig, pattern, model arguments),
  :func:`dry_run`, :func:`load_hf_weights` are its pieces;
* :func:`iter_hf_weights` streams ``(hf_name, tensor)`` in the on-disk names and layouts (what
  RL weight sync sends to an inference engine); :func:`save_hf_checkpoint` writes a folder.

Release folders load as downloaded: block-scaled FP8 (DeepSeek-V3, the Qwen FP8 releases) is
dequantized on load and written back as FP8 (``quantize="source"``), any model can be written or
streamed with its family's FP8 recipe (``quantize="fp8"``, :mod:`megatron_hybrid.hf.fp8`), and a
multimodal Qwen3.5's vision tower is carried through untouched.
"""

from megatron_hybrid.hf import families  # noqa: F401 - each family registers itself
from megatron_hybrid.hf.api import dry_run, load_hf_model
from megatron_hybrid.hf.config import FAMILIES, HFConfigError, HFConversion, conversion_for
from megatron_hybrid.hf.export import save_hf_checkpoint
from megatron_hybrid.hf.io import HFCheckpoint, HFCheckpointError
from megatron_hybrid.hf.plan import PlanReport
from megatron_hybrid.hf.stream import iter_hf_weights
from megatron_hybrid.hf.weights import HFWeightsError, load_hf_weights

__all__ = [
    "FAMILIES",
    "HFCheckpoint",
    "HFCheckpointError",
    "HFConfigError",
    "HFConversion",
    "HFWeightsError",
    "PlanReport",
    "conversion_for",
    "dry_run",
    "iter_hf_weights",
    "load_hf_model",
    "load_hf_weights",
    "save_hf_checkpoint",
]

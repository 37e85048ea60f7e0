"""The language model and the tools that build one: ``HybridModel`` (EP-overlap schedule plan
included), the GPTModel twin of a grouped pattern, and a pattern's expected checkpoint keys."""

from megatron_hybrid.model.expected_keys import expected_checkpoint_tensors
from megatron_hybrid.model.gpt_interop import (
    NotGPTEquivalentError,
    gpt_config_for_pattern,
    gpt_decoder_spec_for_pattern,
)
from megatron_hybrid.model.hybrid_model import HybridModel

__all__ = [
    "HybridModel",
    "NotGPTEquivalentError",
    "expected_checkpoint_tensors",
    "gpt_config_for_pattern",
    "gpt_decoder_spec_for_pattern",
]

"""Per-token log-probabilities and entropies for RL and SFT trainers.

* :func:`token_logprobs` / :func:`token_entropy`: from this rank's vocab-parallel logits, without
  gathering the vocabulary (float32 math, padded vocabulary rows excluded, differentiable);
* :func:`forward_logprobs`: the next-token log-probs (and entropies) of a list of token
  sequences under a model, forward only: packed into THD micro-batches through the padding
  planners, run through megatron-core's schedule (PP and VPP included), returned on every rank in
  input order.

The three names and their arguments are a contract (``docs/user_guide.md``, "Packed sequences and
log-probs"). Importing this package loads no torch; the functions load it on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Tokens per micro-batch of :func:`forward_logprobs` when the caller does not say (alignment
#: padding included).
DEFAULT_MAX_TOKENS = 8192

_LAZY = {
    "forward_logprobs": "forward",
    "token_entropy": "vocab",
    "token_logprobs": "vocab",
}

__all__ = ["DEFAULT_MAX_TOKENS", "forward_logprobs", "token_entropy", "token_logprobs"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""Per-token log-probabilities and entropies for RL and SFT trainers.

* :func:`token_logprobs` / :func:`token_entropy`: from this rank's vocab-parallel logits, without
  gathering the vocabulary (float32 math, padded vocabulary rows excluded, differentiable);
* :func:`forward_logprobs`: the next-token log-probs (and entropies) of a list of token
  sequences under a model, forward only: packed into THD micro-batches through the padding
  planners, run through megatron-core's schedule (PP and VPP included), returned on every rank in
  input order.

The three names and their arguments are a contract (``docs/user_guide.md``, "Packed sequences and
log-probs").
"""

from megatron_hybrid.logprobs.forward import DEFAULT_MAX_TOKENS, forward_logprobs
from megatron_hybrid.logprobs.vocab import token_entropy, token_logprobs

__all__ = ["DEFAULT_MAX_TOKENS", "forward_logprobs", "token_entropy", "token_logprobs"]

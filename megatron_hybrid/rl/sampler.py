"""``sample``: a small, correct sampler for examples, tests and engine-free RL runs.

Each new token recomputes the whole prefix (no KV cache, no recurrent state carried between
steps), so every layer type samples exactly as it scores: the prompts and what has been
generated so far are packed into one THD micro-batch through the padding planners (padded rows
where a layer type cannot pack), the model's logits at each sequence's last position are
gathered over the vocabulary shards, and the next token is drawn on the CPU from one seeded
generator (so every rank of a model replica draws the same one). The cost is a forward pass
over all prefixes per token: for tests and toy runs, not for production rollouts (use an
inference engine, fed by ``iter_hf_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.logprobs.batches import (
    agree,
    check_sequences,
    replica_error,
    sequences_batch,
    world_max,
)
from megatron_hybrid.logprobs.forward import (
    choose_packed,
    evaluating,
    model_device,
    model_logits,
)
from megatron_hybrid.padding import padding_config_from

__all__ = ["choose_tokens", "sample"]


def choose_tokens(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[n, vocab]``.

    ``temperature == 0`` is greedy (the first of the largest logits, as ``argmax`` and
    transformers' greedy search pick); otherwise a draw from ``softmax(logits / temperature)``
    restricted to the smallest set of most likely tokens whose probability reaches ``top_p``
    (nucleus sampling), in float64, with ``generator``.
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        ordered, order = probs.sort(-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the more likely tokens
        ordered = torch.where(before < top_p, ordered, torch.zeros_like(ordered))
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _check(max_new_tokens, temperature, top_p, seed) -> str | None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        return f"max_new_tokens must be an int, got {max_new_tokens!r}"
    if max_new_tokens < 0:
        return f"max_new_tokens must be >= 0, got {max_new_tokens}"
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return f"{name} must be a finite number, got {value!r}"
    if temperature < 0:
        return f"temperature must be >= 0 (0: greedy), got {temperature}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], got {top_p}"
    if isinstance(seed, bool) or not isinstance(seed, int):
        return f"seed must be an int, got {seed!r}"
    return None


def _last_logits(chunk, tokens, padding, packed: bool, pg, vocab: int, device) -> torch.Tensor:
    """``[n, vocab]`` float32 logits after each sequence's last token (full vocabulary)."""
    # One placeholder token after each sequence: its input row is never read, and the span of
    # the sequence then ends at the row that predicts the token after the real ones.
    extended = [torch.cat([t, t.new_zeros(1)]) for t in tokens]
    batch = sequences_batch(
        extended, range(len(extended)), padding, packed=packed, equalize_group=pg.tp_ep
    )
    inputs = batch.to(device).inputs
    output = model_logits(chunk, inputs, gather_output=True)  # the whole vocabulary everywhere
    last = torch.tensor([first + n - 1 for _, first, n in batch.spans], device=device)
    return output.reshape(-1, output.size(-1))[last, :vocab].float()


def sample(
    model,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int,
) -> list[torch.Tensor]:
    """Continue each prompt by ``max_new_tokens`` tokens (collective over the world).

    Args:
        model: this rank's model (``load_hf_model``'s, or a ``train``-built chunk), without
            pipeline parallelism.
        prompts: 1-D integer token tensors, any lengths >= 1. Every rank of a model replica
            passes the same prompts; data-parallel replicas may pass their own.
        max_new_tokens: tokens to generate per prompt (no stop token: every continuation has
            this length).
        temperature: 0 for greedy decoding, else the softmax temperature.
        top_p: nucleus sampling's probability mass (1: the whole distribution).
        seed: seed of the draws (pass different seeds to data-parallel replicas that should
            draw differently).

    Returns:
        The generated tokens of each prompt (``int64`` on the CPU, ``max_new_tokens`` each), in
        prompt order, the same on every rank of a replica.

    Raises:
        ValueError: bad prompts or settings (on every rank, before any forward pass), or a
            pipeline-parallel model.
    """
    from megatron.core.utils import get_model_config

    chunks = model_chunks(model)
    chunk = chunks[0]
    config = get_model_config(chunk)
    pg = chunk.pg_collection
    device = model_device(chunks)
    where = "sample"
    error = _check(max_new_tokens, temperature, top_p, seed)
    if error is None and (len(chunks) > 1 or pg.pp.size() > 1):
        error = "pipeline parallelism is not supported; load the model with PP 1 to sample"
    if error is None and pg.cp.size() > 1:
        error = "context parallelism is not supported; load the model with CP 1 to sample"
    tokens: list[torch.Tensor] = []
    if error is None:
        error, tokens = check_sequences(prompts, chunk.vocab_size)
    agree(error, device, where)
    agree(replica_error(tokens, pg.mp, device), device, where)
    steps = world_max([max_new_tokens, -max_new_tokens], device)
    if steps[0] != -steps[1]:
        agree("the ranks passed different max_new_tokens; pass the same everywhere", device, where)
    padding = padding_config_from(config, pg)
    packed = choose_packed(chunk, config, None)
    generator = torch.Generator().manual_seed(seed)
    generated = [torch.zeros(0, dtype=torch.long) for _ in tokens]
    with evaluating([chunk]):
        for _ in range(max_new_tokens):
            current = [torch.cat([t, g]) for t, g in zip(tokens, generated, strict=True)]
            logits = _last_logits(chunk, current, padding, packed, pg, chunk.vocab_size, device)
            chosen = choose_tokens(
                logits, temperature=temperature, top_p=top_p, generator=generator
            ).cpu()
            generated = [torch.cat([g, chosen[i : i + 1]]) for i, g in enumerate(generated)]
    return generated

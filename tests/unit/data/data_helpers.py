"""Rows and data sets the data tests share."""

from __future__ import annotations

import math
import random
import string

import numpy as np

#: The fixed answer of :func:`chat_rows`.
ANSWER = "the answer is always forty two"
#: Prompt words: this many random lower-case letters each, this many words (inclusive).
WORD_LETTERS, PROMPT_WORDS = 3, (4, 8)


def chat_rows(count: int, *, seed: int = 0, turns: int = 1) -> list[dict]:
    """Conversations whose user prompts are random letters and whose answers are
    :data:`ANSWER`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": "answer briefly"}]
        for _ in range(turns):
            words = rng.randint(*PROMPT_WORDS)
            prompt = " ".join(
                "".join(rng.choice(string.ascii_lowercase) for _ in range(WORD_LETTERS))
                for _ in range(words)
            )
            messages += [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": ANSWER},
            ]
        rows.append({"messages": messages})
    return rows


def prompt_entropy(rows: list[dict]) -> float:
    """The prompts' entropy in nats: uniform letters and uniform word counts."""
    prompts = [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]
    letters = sum(len(p.replace(" ", "")) for p in prompts)
    choices = PROMPT_WORDS[1] - PROMPT_WORDS[0] + 1
    return letters * math.log(26) + len(prompts) * math.log(choices)


def write_indexed(prefix, documents, dtype=np.uint16) -> str:
    """A data set written with megatron-core's own ``IndexedDatasetBuilder`` (one sequence per
    document), not by this package."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(torch.as_tensor(np.asarray(document)), [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_documents(count: int, vocab: int, *, seed: int = 0, lengths=(3, 40)) -> list:
    """``count`` documents of random token ids in ``[1, vocab)``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(*lengths))) for _ in range(count)]

"""Rows and data sets the data tests share."""

from __future__ import annotations

import random

import numpy as np

#: The fixed answer of :func:`chat_rows`.
ANSWER = "the answer is always forty two"
_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "mu")


def chat_rows(count: int, *, seed: int = 0, turns: int = 1) -> list[dict]:
    """Conversations whose user prompts are random words and whose answers are :data:`ANSWER`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": "answer briefly"}]
        for _ in range(turns):
            prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
            messages += [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": ANSWER},
            ]
        rows.append({"messages": messages})
    return rows


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

"""Small Hugging Face tokenizers and text built locally, for data tests and benchmarks.

:func:`build_tokenizer` trains a byte-level BPE (the ``tokenizers`` library) on text at hand,
wraps it in transformers' ``PreTrainedTokenizerFast`` with a ChatML chat template and saves it
with ``save_pretrained``: a real tokenizer folder, made in a second, with no download.
:func:`package_text` is that text: the package's own source files (English docstrings and
code), which every installation has.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "CHATML",
    "CHATML_GENERATION",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "package_text",
    "text_rows",
    "write_jsonl",
]

#: End of document, turn start, turn end, padding.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

#: ChatML (Qwen's turn format), with no markers of the assistant's tokens.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The same rendering with the assistant's content and end of turn in ``{% generation %}``.
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def package_text() -> list[str]:
    """The non-empty lines of the package's own source files, in a fixed order."""
    root = Path(__file__).resolve().parents[1]
    lines = []
    for path in sorted(root.rglob("*.py")):
        lines += [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return lines


def build_tokenizer(
    folder: str | os.PathLike,
    *,
    vocab_size: int = 512,
    chat_template: str | None = CHATML,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Train a byte-level BPE tokenizer and save it as a Hugging Face folder.

    Args:
        folder: where to save it (created).
        vocab_size: the vocabulary, special tokens included.
        chat_template: its chat template (None: none).
        corpus: the training text (default: :func:`package_text`).

    Returns:
        The folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus if corpus is not None else package_text()), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[3],
        chat_template=chat_template,
    )
    wrapped.save_pretrained(str(folder))
    return Path(folder)


def text_rows(count: int, *, seed: int = 0, lines_per_row: Sequence[int] = (1, 8)) -> list[dict]:
    """``count`` rows ``{"text": ...}`` of consecutive package source lines (random spans)."""
    lines = package_text()
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        n = rng.randint(*lines_per_row)
        start = rng.randrange(0, len(lines) - n)
        rows.append({"text": "\n".join(lines[start : start + n])})
    return rows


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """One JSON object per line."""
    with open(path, "w") as stream:
        for row in rows:
            stream.write(json.dumps(row) + "\n")
    return Path(path)

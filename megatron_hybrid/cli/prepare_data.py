"""``prepare-data``: tokenize JSONL files into Megatron's ``.bin``/``.idx`` data sets.

The flags are those of Megatron-LM's ``tools/preprocess_data.py`` (``--input``,
``--output-prefix``, ``--tokenizer-model``, ``--json-keys``, ``--append-eod``, ``--workers``),
with a Hugging Face tokenizer folder, several input files, and chat rows: a value that is a list
of ``{"role", "content"}`` messages is rendered with the tokenizer's chat template and gets a
loss mask that keeps the assistant's tokens only (stored beside the tokens as
``PREFIX_loss_mask.bin/.idx``). Train on the result with ``train --data-path PREFIX``.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_hybrid.cli.main import Command, add_overwrite_flag
from megatron_hybrid.data.prepare import PrepareOptions, RowError, check_options, prepare_data

__all__ = ["COMMAND"]


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "%(prog)s --input FILE.jsonl [FILE ...] --output-prefix PREFIX --tokenizer-model HF_DIR "
        "[options]"
    )
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="JSONL files, one JSON object per line, read in order",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys whose values become documents, one data set each: a string is text, a list "
        'of {"role", "content"} messages a chat (use --json-keys messages for chat files)',
    )
    group = parser.add_argument_group("tokenization")
    group.add_argument(
        "--tokenizer-model",
        required=True,
        metavar="HF_DIR",
        help="a Hugging Face tokenizer folder (transformers' AutoTokenizer; chats use its chat "
        "template)",
    )
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="end every non-empty document with the tokenizer's end-of-sequence token",
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="writes PREFIX_{key}_document.bin/.idx per key (and _loss_mask.bin/.idx beside "
        "a data set with chat rows); train with --data-path PREFIX_{key}_document",
    )
    add_overwrite_flag(
        group,
        "--output-prefix PREFIX",
        "its .bin/.idx files, and a loss-mask pair the new data no longer has",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers", type=int, default=1, help="encoding processes (1: this process)"
    )


def _run(args: argparse.Namespace) -> int:
    options = PrepareOptions(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    check_options(options)  # before the progress bar: bad flags print one line
    bar = _Bar(sum(os.path.getsize(path) for path in options.inputs))
    try:
        summary = prepare_data(options, progress=bar.update)
    except RowError as error:
        raise ValueError(f"{error}; nothing was written") from None
    finally:
        bar.close()
    print(_summary_line(summary), flush=True)
    return 0


class _Bar:
    """tqdm over input bytes, with documents and tokens/s beside it (on stderr); shown from the
    first chunk on, so that the libraries' start-up is not counted in its rate."""

    def __init__(self, total: int):
        self.total, self.read, self.bar = total, 0, None

    def update(self, documents: int, tokens: int, read: int, seconds: float) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="B", unit_scale=True, file=sys.stderr,
                            leave=False, desc="prepare-data", dynamic_ncols=True)  # fmt: skip
        self.bar.set_postfix_str(f"{documents:,} docs, {tokens / max(seconds, 1e-9):,.0f} tok/s")
        self.bar.update(read - self.read)
        self.read = read

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _summary_line(summary) -> str:
    files = ", ".join(f"{prefix}.bin/.idx" for prefix in summary.prefixes.values())
    chat = f", {summary.chat_documents:,} chat rows" if summary.chat_documents else ""
    masked = [f"{summary.prefixes[key]}_loss_mask.bin/.idx" for key in summary.masked]
    masks = f" (loss masks: {', '.join(masked)})" if masked else ""
    return (
        f"prepared {summary.documents:,} documents ({summary.tokens:,} tokens{chat}) in "
        f"{summary.seconds:.2f} s, {summary.tokens_per_second:,.0f} tokens/s: {files}{masks}"
    )


COMMAND = Command(
    name="prepare-data",
    help="tokenize JSONL files (text or chats) into Megatron .bin/.idx data sets for train",
    configure=_configure,
    run=_run,
    description=__doc__,
)

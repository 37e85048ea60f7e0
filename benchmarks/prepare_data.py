"""``prepare-data`` throughput against the tokenizer's own batch encoding (the floor).

Builds a byte-level BPE tokenizer and a JSONL corpus from the package's own source text (no
download), then times, on this machine:

- the floor: the tokenizer's batch encoding of the same texts, already in memory (one call per
  512 texts, and one call for all of them; the faster counts);
- ``prepare-data`` itself, end to end: reading and parsing the JSONL, encoding, writing the
  ``.bin``/``.idx`` (megatron-core's ``IndexedDatasetBuilder``), with ``--workers`` 1 and 2;
- the same for chat rows: the floor is ``apply_chat_template(..., tokenize=True)``; prepare-data
  also finds the assistant tokens (a template without ``{% generation %}`` renders every
  conversation prefix by prefix, one with it asks transformers for the mask).

Target (``docs/performance.md``): text within 2x of the floor. Library start-up (imports, the
tokenizer load) is outside every timing; each figure is the best of ``--repeats`` runs.
``--keep DIR`` also leaves the tokenizer (``DIR/tokenizer``) and a prepared text data set
(``DIR/corpus_text_document``) there, for ``train --data-path``.

Usage::

    python benchmarks/prepare_data.py [--documents 10000] [--out benchmarks/results] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name, recorded_command  # noqa: E402

from megatron_hybrid.data.prepare import CHUNK_LINES, PrepareOptions, prepare_data  # noqa: E402
from megatron_hybrid.testing.tokenizers import (  # noqa: E402
    CHATML,
    CHATML_GENERATION,
    build_tokenizer,
    text_rows,
    write_jsonl,
)

TARGET_RATIO = 2.0


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def chat_rows(count: int) -> list[dict]:
    rows = text_rows(2 * count, seed=3, lines_per_row=(1, 6))
    return [
        {"messages": [{"role": "user", "content": rows[2 * i]["text"]},
                      {"role": "assistant", "content": rows[2 * i + 1]["text"]}]}
        for i in range(count)
    ]  # fmt: skip


def floor_seconds(tokenizer, values, chat: bool, repeats: int) -> float:
    if chat:

        def encode(batch):
            return tokenizer.apply_chat_template(batch, tokenize=True)

    else:

        def encode(batch):
            return tokenizer(batch, return_attention_mask=False)

    chunked = best(
        lambda: [encode(values[i : i + CHUNK_LINES]) for i in range(0, len(values), CHUNK_LINES)],
        repeats,
    )
    return min(chunked, best(lambda: encode(values), repeats))


def ours_seconds(options: PrepareOptions, repeats: int) -> tuple[float, int]:
    times, tokens = [], 0
    for _ in range(repeats):
        summary = prepare_data(options)
        times.append(summary.seconds)
        tokens = summary.tokens
    return min(times), tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=10000, help="text rows (chat: a third)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the BPE's vocabulary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write prepare_data_CPU.json/.md there")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep tokenizer and data")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: F401
    from transformers import AutoTokenizer

    work = Path(args.keep or tempfile.mkdtemp(prefix="prepare-data-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for name, template in (("plain", CHATML), ("generation", CHATML_GENERATION)):
            build_tokenizer(work / f"tokenizer-{name}", vocab_size=args.vocab_size,
                            chat_template=template)  # fmt: skip
        if args.keep:
            shutil.copytree(work / "tokenizer-plain", work / "tokenizer", dirs_exist_ok=True)
        texts = text_rows(args.documents, seed=1, lines_per_row=(5, 60))
        write_jsonl(work / "corpus.jsonl", texts)
        chats = chat_rows(args.documents // 3)
        write_jsonl(work / "chat.jsonl", chats)
        cases = [("text", "plain", 1), ("text", "plain", 2), ("chat", "plain", 1),
                 ("chat", "generation", 1)]  # fmt: skip
        for kind, template, workers in cases:
            folder = work / f"tokenizer-{template}"
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            if kind == "text":
                values = [t["text"] for t in texts]
            else:
                values = [c["messages"] for c in chats]
            floor = floor_seconds(tokenizer, values, kind == "chat", args.repeats)
            source = work / ("corpus.jsonl" if kind == "text" else "chat.jsonl")
            options = PrepareOptions(
                inputs=(str(source),),
                output_prefix=str(work / ("corpus" if kind == "text" else "chat")),
                tokenizer_model=str(folder),
                json_keys=("text",) if kind == "text" else ("messages",),
                append_eod=True,
                workers=workers,
                overwrite=True,
            )
            seconds, tokens = ours_seconds(options, args.repeats)
            if kind == "text":
                key = f"text (--workers {workers})"
            else:
                marks = (
                    "{% generation %} template" if template == "generation" else "plain template"
                )
                key = f"chat ({marks}, --workers {workers})"
            results[key] = {
                "documents": len(values),
                "tokens": tokens,
                "floor_seconds": floor,
                "prepare_data_seconds": seconds,
                "floor_tokens_per_second": tokens / floor,
                "prepare_data_tokens_per_second": tokens / seconds,
                "ratio": seconds / floor,
            }
            print(f"{key}: {tokens / seconds:,.0f} tok/s, floor {tokens / floor:,.0f} tok/s, "
                  f"{seconds / floor:.2f}x", flush=True)  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    record = {
        "benchmark": "prepare_data",
        "date": datetime.date.today().isoformat(),
        "command": recorded_command("prepare_data.py", argv),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "target_ratio_text": TARGET_RATIO,
        "results": results,
    }
    if args.out:
        _write(Path(args.out), record)
    text = [v["ratio"] for k, v in results.items() if k.startswith("text")]
    return 0 if max(text) <= TARGET_RATIO else 1


def _write(folder: Path, record: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prepare_data_CPU.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# prepare-data throughput ({record['date']}, {record['machine']})",
        "",
        f"`{record['command']}`: against the tokenizer's own batch encoding of the same texts "
        f"(the floor), best of the repeats; target for text: within {TARGET_RATIO:g}x.",
        "",
        "| case | documents | tokens | prepare-data tok/s | floor tok/s | time / floor |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, r in record["results"].items():
        lines.append(
            f"| {key} | {r['documents']:,} | {r['tokens']:,} | "
            f"{r['prepare_data_tokens_per_second']:,.0f} | {r['floor_tokens_per_second']:,.0f} | "
            f"{r['ratio']:.2f}x |"
        )
    (folder / "prepare_data_CPU.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

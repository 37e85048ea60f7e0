"""``prepare-data``: JSONL files to Megatron's ``.bin``/``.idx``, with loss masks for chat rows.

Every line of the input files is a JSON object; for each ``--json-keys`` key its value becomes one
document of the data set ``{output_prefix}_{key}_document`` (Megatron-LM's
``tools/preprocess_data.py`` names and layout: one sequence per document, ``uint16`` ids below
65,500 tokens and ``int32`` above, written with megatron-core's ``IndexedDatasetBuilder``). A
string is tokenized as Megatron-LM's Hugging Face tokenizer does (``tokenizer(text).input_ids``);
a list of ``{"role", "content"}`` messages is rendered with the tokenizer's chat template and
gets a loss mask (:mod:`megatron_hybrid.data.chat`, stored as :mod:`megatron_hybrid.data.files`
describes). ``--append-eod`` ends every non-empty document with the tokenizer's end-of-sequence
token, as Megatron-LM does.

Work is split into chunks of lines, encoded with the tokenizer's batch encoding in ``--workers``
processes (in this process for one worker) and written in input order. Everything is written
under temporary names and renamed at the end: a malformed line (reported with its file and line
number), an interrupt or any other failure leaves no output behind.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_hybrid.data.chat import ChatError, ChatRenderer, check_messages, is_chat
from megatron_hybrid.data.files import dataset_prefix, loss_mask_prefix
from megatron_hybrid.data.tokenizer import load_tokenizer, tokenizer_size

__all__ = ["PrepareOptions", "PrepareSummary", "RowError", "prepare_data"]

#: Lines per chunk of work (one batch encoding call per key).
CHUNK_LINES = 512
_PARTIAL = ".partial"


class RowError(ValueError):
    """A line of an input file that cannot be used: ``FILE:LINE: what is wrong``."""

    def __init__(self, path: str, line: int, message: str):
        super().__init__(f"{path}:{line}: {message}")
        self.path, self.line = path, line


@dataclass(frozen=True)
class PrepareOptions:
    """What to prepare (the ``prepare-data`` flags).

    Attributes:
        inputs: JSONL files, read in order.
        output_prefix: the output path without ``_{key}_document.bin``.
        tokenizer_model: a Hugging Face tokenizer folder.
        json_keys: the keys whose values become documents (one data set each).
        append_eod: end every non-empty document with the end-of-sequence token.
        workers: encoding processes (1: this process).
        overwrite: replace existing output files.
    """

    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer_model: str
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    overwrite: bool = False


@dataclass
class PrepareSummary:
    """What a run wrote.

    Attributes:
        prefixes: JSON key -> the data set prefix written for it.
        masked: the keys whose data set has a loss mask (it held chat rows).
        documents, tokens, chat_documents: counts over every key.
        bytes_read: input bytes.
        seconds: wall time.
    """

    prefixes: dict[str, str]
    masked: tuple[str, ...] = ()
    documents: int = 0
    tokens: int = 0
    chat_documents: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Chunk:
    path: str
    lines: list[tuple[int, bytes]]
    size: int


def _chunks(inputs: Sequence[str], lines_per_chunk: int) -> Iterator[_Chunk]:
    for path in inputs:
        with open(path, "rb") as stream:
            numbered = ((n, line) for n, line in enumerate(stream, start=1) if line.strip())
            while batch := list(itertools.islice(numbered, lines_per_chunk)):
                yield _Chunk(path, batch, sum(len(line) for _, line in batch))


# ----------------------------------------------------------------------------- encoding


@dataclass
class _Documents:
    """One key's documents of a chunk: ids back to back, their lengths, masks (None: no chat)."""

    ids: np.ndarray
    lengths: np.ndarray
    masks: np.ndarray | None
    chat: int = 0


class _Encoder:
    """Turns chunks of lines into documents (one per process)."""

    def __init__(self, tokenizer_model: str, keys: Sequence[str], append_eod: bool, tokenizer=None):
        self.tokenizer = tokenizer or load_tokenizer(tokenizer_model)
        self.keys = tuple(keys)
        self.eod = self.tokenizer.eos_token_id if append_eod else None
        self._renderer: ChatRenderer | None = None

    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer)
        return self._renderer

    def encode(self, chunk: _Chunk) -> dict[str, _Documents] | RowError:
        try:
            rows = [self._row(chunk.path, n, line) for n, line in chunk.lines]
            return {key: self._key(chunk, rows, key) for key in self.keys}
        except RowError as error:
            return error

    def _row(self, path: str, line: int, raw: bytes) -> dict:
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            reason = getattr(error, "msg", None) or str(error)
            raise RowError(path, line, f"not valid JSON ({reason})") from None
        if not isinstance(row, dict):
            raise RowError(path, line, f"expected a JSON object, got {type(row).__name__}")
        for key in self.keys:
            if key not in row:
                hint = " (a chat file: pass --json-keys messages)" if "messages" in row else ""
                raise RowError(path, line, f"no {key!r} key (the row has {sorted(row)}){hint}")
            value = row[key]
            if isinstance(value, str):
                continue
            if not is_chat(value):
                raise RowError(
                    path,
                    line,
                    f"{key!r} holds {type(value).__name__}: expected a string (text) or a list "
                    'of {"role": ..., "content": ...} messages (chat)',
                )
            try:
                check_messages(value)
            except ChatError as error:
                raise RowError(path, line, f"{key!r}: {error}") from None
        return row

    def _key(self, chunk: _Chunk, rows: list[dict], key: str) -> _Documents:
        values = [row[key] for row in rows]
        texts = [i for i, v in enumerate(values) if isinstance(v, str)]
        chats = [i for i, v in enumerate(values) if not isinstance(v, str)]
        docs: list = [None] * len(values)
        masks: list = [None] * len(values)
        if texts:
            encoded = self.tokenizer([values[i] for i in texts], return_attention_mask=False)
            for i, ids in zip(texts, encoded["input_ids"], strict=True):
                docs[i] = ids
        if chats:
            try:
                renderer = self.renderer()
                encoded = renderer.encode([values[i] for i in chats])
            except ChatError as error:
                where = chats[getattr(error, "index", 0)]
                raise RowError(chunk.path, chunk.lines[where][0], f"{key!r}: {error}") from None
            for i, (ids, mask) in zip(chats, encoded, strict=True):
                docs[i], masks[i] = ids, mask
        return self._pack(docs, masks if chats else None, len(chats))

    def _pack(self, docs: list, masks: list | None, chat: int) -> _Documents:
        if self.eod is not None:  # Megatron-LM appends no EOD to an empty document
            docs = [_with_eod(d, self.eod) if len(d) else d for d in docs]
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        ids = np.fromiter(itertools.chain.from_iterable(docs), np.int64, count=int(lengths.sum()))
        if masks is None:
            return _Documents(ids, lengths, None)
        # Text rows among chat rows are trained on whole; an appended EOD is no assistant token.
        full = [
            np.ones(n, np.uint8) if m is None else np.append(m, np.zeros(n - len(m), np.uint8))
            for m, n in zip(masks, lengths.tolist(), strict=True)
        ]
        return _Documents(ids, lengths, np.concatenate(full), chat)


def _with_eod(doc, eod: int):
    if isinstance(doc, np.ndarray):
        return np.append(doc, eod)
    doc.append(eod)
    return doc


_WORKER: _Encoder | None = None


def _init_worker(tokenizer_model: str, keys: Sequence[str], append_eod: bool) -> None:
    # One tokenizer thread per worker process: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _WORKER
    _WORKER = _Encoder(tokenizer_model, keys, append_eod)


def _encode_in_worker(chunk: _Chunk):
    return _WORKER.encode(chunk)


# ----------------------------------------------------------------------------- writing


@dataclass
class _DatasetWriter:
    """One data set under temporary names: tokens, and a loss mask from the first chat row on."""

    prefix: str
    dtype: type
    tokens: object = None
    mask: object = None
    documents: int = 0
    written: int = 0
    chat: int = 0
    files: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.tokens = self._builder(self.prefix, self.dtype)

    def _builder(self, prefix: str, dtype):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        path = f"{prefix}.bin{_PARTIAL}"
        self.files += [path, f"{prefix}.idx{_PARTIAL}"]
        return IndexedDatasetBuilder(path, dtype=dtype)

    def add(self, docs: _Documents) -> None:
        if docs.masks is not None and self.mask is None:
            self._start_mask()
        offsets = np.concatenate([[0], np.cumsum(docs.lengths)])
        ids = docs.ids
        for a, b in itertools.pairwise(offsets.tolist()):
            self.tokens.add_document(ids[a:b], [b - a] if b > a else [])
            if self.mask is not None:
                mask = docs.masks[a:b] if docs.masks is not None else np.ones(b - a, np.uint8)
                self.mask.add_document(mask, [b - a] if b > a else [])
        self.documents += len(docs.lengths)
        self.written += len(ids)
        self.chat += docs.chat

    def _start_mask(self) -> None:
        """The loss mask of the documents so far (all trained on), from the tokens' layout."""
        self.mask = self._builder(loss_mask_prefix(self.prefix), np.uint8)
        lengths, bounds = self.tokens.sequence_lengths, self.tokens.document_indices
        for a, b in itertools.pairwise(bounds):
            seqs = lengths[a:b]
            self.mask.add_document(np.ones(sum(seqs), np.uint8), list(seqs))

    def finish(self) -> list[tuple[str, str]]:
        """Write the indices; return ``(temporary, final)`` file names."""
        self.tokens.finalize(f"{self.prefix}.idx{_PARTIAL}")
        if self.mask is not None:
            self.mask.finalize(f"{loss_mask_prefix(self.prefix)}.idx{_PARTIAL}")
        return [(path, path.removesuffix(_PARTIAL)) for path in self.files]

    def abandon(self) -> None:
        for builder in (self.tokens, self.mask):
            if builder is not None and not builder.data_file.closed:
                builder.data_file.close()
        for path in self.files:
            Path(path).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the run


def _outputs(options: PrepareOptions) -> dict[str, str]:
    return {key: dataset_prefix(options.output_prefix, key) for key in options.json_keys}


def _existing(prefixes: dict[str, str]) -> list[str]:
    found = []
    for prefix in prefixes.values():
        for base in (prefix, loss_mask_prefix(prefix)):
            found += [f"{base}.{ext}" for ext in ("bin", "idx") if os.path.exists(f"{base}.{ext}")]
    return found


def check_options(options: PrepareOptions) -> None:
    """Refuse what would fail later, before any work.

    Raises:
        ValueError: naming the flag and the fix.
    """
    for path in options.inputs:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path} is not a file")
    folder = Path(options.output_prefix).parent
    if not folder.is_dir():
        raise ValueError(
            f"--output-prefix {options.output_prefix}: the folder {folder} does not exist; "
            "create it first"
        )
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output-prefix {options.output_prefix}: {folder} is not writable")
    if len(set(options.json_keys)) != len(options.json_keys):
        raise ValueError(f"--json-keys {' '.join(options.json_keys)} names a key twice")
    if options.workers < 1:
        raise ValueError(f"--workers {options.workers} must be >= 1")
    existing = _existing(_outputs(options))
    if existing and not options.overwrite:
        raise ValueError(
            f"--output-prefix {options.output_prefix}: {', '.join(existing)} already exist; "
            "pass --overwrite to replace them or choose another prefix"
        )


def _results(options: PrepareOptions, tokenizer) -> Iterator[tuple[_Chunk, object]]:
    """``(chunk, encoded)`` in input order, from this process or a window of workers."""
    chunks = _chunks(options.inputs, CHUNK_LINES)
    args = (options.tokenizer_model, options.json_keys, options.append_eod)
    if options.workers == 1:
        encoder = _Encoder(*args, tokenizer=tokenizer)
        for chunk in chunks:
            yield chunk, encoder.encode(chunk)
        return
    import multiprocessing

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(options.workers, initializer=_init_worker, initargs=args) as pool:
        window: deque = deque()
        for chunk in chunks:  # a bounded window keeps memory flat on large inputs
            window.append((chunk, pool.apply_async(_encode_in_worker, (chunk,))))
            if len(window) >= 4 * options.workers:
                done, result = window.popleft()
                yield done, result.get()
        while window:
            done, result = window.popleft()
            yield done, result.get()


def prepare_data(
    options: PrepareOptions, progress: Callable[[int, int, int, float], None] | None = None
) -> PrepareSummary:
    """Tokenize ``options.inputs`` into Megatron data sets; see the module docstring.

    Args:
        options: what to prepare.
        progress: called after every chunk with ``(documents, tokens, bytes read, seconds)``
            so far.

    Raises:
        RowError: a line that cannot be used (nothing is written).
        ValueError: bad options or a tokenizer that cannot be used (before any work).
    """
    from megatron.core.datasets.indexed_dataset import DType

    check_options(options)
    began = time.perf_counter()
    tokenizer = load_tokenizer(options.tokenizer_model)
    if options.append_eod and tokenizer.eos_token_id is None:
        raise ValueError(
            f"--append-eod: the tokenizer {options.tokenizer_model} has no end-of-sequence "
            "token to append"
        )
    # Megatron-LM's choice: uint16 ids below 65,500 tokens, int32 above.
    dtype = DType.optimal_dtype(tokenizer_size(tokenizer))
    prefixes = _outputs(options)
    writers = {key: _DatasetWriter(prefix, dtype) for key, prefix in prefixes.items()}
    summary = PrepareSummary(prefixes)
    try:
        for chunk, encoded in _results(options, tokenizer):
            if isinstance(encoded, RowError):
                raise encoded
            for key, docs in encoded.items():
                writers[key].add(docs)
            summary.bytes_read += chunk.size
            if progress is not None:
                first = writers[options.json_keys[0]]
                tokens = sum(w.written for w in writers.values())
                elapsed = time.perf_counter() - began
                progress(first.documents, tokens, summary.bytes_read, elapsed)
        empty = [w.prefix for w in writers.values() if w.written == 0]
        if empty:
            raise ValueError(
                f"{', '.join(options.inputs)} hold no tokens for {', '.join(empty)}: every "
                "document is empty"
            )
        renames = [pair for w in writers.values() for pair in w.finish()]
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    for writer in writers.values():  # an overwritten data set keeps no stale loss mask
        if writer.mask is None:
            for ext in ("bin", "idx"):
                Path(f"{loss_mask_prefix(writer.prefix)}.{ext}").unlink(missing_ok=True)
    for temporary, final in renames:
        os.replace(temporary, final)
    summary.masked = tuple(k for k, w in writers.items() if w.mask is not None)
    summary.documents = sum(w.documents for w in writers.values())
    summary.tokens = sum(w.written for w in writers.values())
    summary.chat_documents = sum(w.chat for w in writers.values())
    summary.seconds = time.perf_counter() - began
    return summary

"""What a ``train`` run reads: its data, tokenizer and vocabulary, and the micro-batch layout.

Before any process group exists, :func:`resolve_data` completes the flags: the tokenizer
(``--tokenizer-model``, else the ``--load-hf`` folder's), the model's vocabulary (the
tokenizer's padded as Megatron-LM pads it unless ``--vocab-size`` or a Hugging Face model sets
it) and the files of ``--data-path``, refusing a missing or damaged file and a tokenizer larger
than the vocabulary. Then :class:`RunInputs` decides the layout once (packed THD micro-batches of
a fixed token budget where the pattern packs, padded rows otherwise), checks every token id
against the vocabulary, and, once the run knows where it resumes, opens the train and
validation splits: megatron-core ``GPTDataset`` blends (:mod:`megatron_hybrid.data.gpt`) or the
built-in synthetic tokens.

Sample ``i`` of a split is the same whatever the parallel layout: global batch ``k`` of a run
holds samples ``[consumed + k * global_batch, ...)``, and data-parallel rank ``r`` builds its
micro-batches from the ``r``-th share. So the data position is one number, the consumed sample
count a checkpoint records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megatron_hybrid.data.batches import build_micro_batch, packed_token_budget
from megatron_hybrid.data.files import check_prefix, describe_size, largest_token_id
from megatron_hybrid.data.gpt import (
    DEFAULT_SPLIT,
    GPTSamples,
    build_gpt_datasets,
    check_split,
    empty_split,
    gpt_dataset_config,
    parse_data_path,
)
from megatron_hybrid.data.synthetic import SyntheticSamples, SyntheticTokens
from megatron_hybrid.data.tokenizer import (
    has_tokenizer,
    load_tokenizer,
    megatron_tokenizer,
    tokenizer_size,
    vocab_size_with_padding,
)
from megatron_hybrid.padding import padding_config_from, thd_unsupported_reason_for
from megatron_hybrid.training.settings import SettingsError
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "RunInputs",
    "StepFeed",
    "data_change_notes",
    "data_record",
    "resolve_data",
]

#: The model's vocabulary when no tokenizer gives one (the synthetic data's).
DEFAULT_VOCAB_SIZE = 256

#: Padded rows of variable length on GPUs take one of this many lengths up to the sequence
#: length. Work specialised to a shape (kernel plans, autotuning, compiled graphs, allocator
#: blocks) is then done for a few shapes in the first steps, not again for nearly every
#: micro-batch; a row carries at most ``seq_length / LENGTH_BUCKETS`` padding tokens more.
LENGTH_BUCKETS = 8


def row_length_bucket(seq_length: int, multiple: int, buckets: int = LENGTH_BUCKETS) -> int:
    """The step between the row lengths of padded micro-batches: a multiple of ``multiple``
    (the padding alignment) that splits ``seq_length`` into at most ``buckets`` lengths.

    >>> row_length_bucket(4096, 8), row_length_bucket(4000, 64), row_length_bucket(32, 8)
    (512, 512, 8)
    """
    return max(multiple, -(-seq_length // (buckets * multiple)) * multiple)


def resolve_data(
    args: TrainSettings, *, hf_folder: str | None = None, vocab_from: str | None = None
) -> TrainSettings:
    """``args`` with ``tokenizer_model`` and ``vocab_size`` filled in, the ``--data-path`` files
    checked (on every rank alike, before any process group).

    Args:
        hf_folder: the Hugging Face folder the model comes from (its tokenizer is the default).
        vocab_from: what set ``args.vocab_size`` when not the flag (a Hugging Face model).

    Raises:
        SettingsError: a bad ``--data-path`` or ``--split``, a missing or damaged data file, no
            tokenizer for ``--data-path``, or a tokenizer larger than the model's vocabulary.
    """
    data_path, split, tokenizer = args.data_path, args.split, args.tokenizer_model
    if tokenizer is None and hf_folder is not None and has_tokenizer(hf_folder):
        tokenizer = hf_folder
    try:
        if split is not None and not data_path:
            raise ValueError("--split divides --data-path; give --data-path too")
        if data_path:
            prefixes, _ = parse_data_path(data_path)
            fractions = check_split(split or DEFAULT_SPLIT)
            if args.eval_interval and not fractions[1]:
                raise ValueError(
                    f"--eval-interval needs a validation split, but --split {split} gives it "
                    "nothing: e.g. --split 98,2,0"
                )
            if tokenizer is None:
                where = f" ({hf_folder} holds none)" if hf_folder else ""
                raise ValueError(
                    "--data-path needs the tokenizer the data was prepared with: add "
                    f"--tokenizer-model HF_DIR{where}"
                )
            for prefix in prefixes:
                problem = empty_split(check_prefix(prefix), split or DEFAULT_SPLIT)
                if problem:
                    raise ValueError(problem)
        vocab = args.vocab_size
        if tokenizer is not None:
            size = tokenizer_size(load_tokenizer(tokenizer))
            if vocab is None:
                tp = args.tensor_model_parallel_size
                vocab = vocab_size_with_padding(size, args.make_vocab_size_divisible_by, tp)
            elif size > vocab:
                fix = "" if vocab_from else " or drop --vocab-size (the tokenizer's is then used)"
                raise ValueError(
                    f"the tokenizer {tokenizer} has {size} tokens, more than the model's "
                    f"vocabulary of {vocab} ({vocab_from or '--vocab-size'}): pass the model's "
                    f"own tokenizer with --tokenizer-model{fix}"
                )
    except ValueError as error:  # DataFileError too
        raise SettingsError(str(error)) from None
    return dataclasses.replace(
        args, tokenizer_model=tokenizer, vocab_size=vocab or DEFAULT_VOCAB_SIZE
    )


def data_record(args: TrainSettings) -> dict:
    """What a checkpoint records about the data it was trained on (a resume on other data is
    named at start-up)."""
    return {
        "data_path": list(args.data_path) if args.data_path else None,
        "split": (args.split or DEFAULT_SPLIT) if args.data_path else None,
        "seq_length": args.seq_length,
        "seed": args.seed,
    }


def data_change_notes(
    recorded: dict | None, args: TrainSettings, folder, consumed: int
) -> list[str]:
    """A note when a resumed checkpoint was trained on other data than this run reads."""
    ours = data_record(args)
    if recorded is None or recorded == ours:
        return []
    return [
        f"{folder} was trained on other data ({_data_text(recorded)}); this run reads "
        f"{_data_text(ours)} and continues at its sample {consumed:,}"
    ]


def _data_text(record: dict) -> str:
    data = record.get("data_path")
    what = f"--data-path {' '.join(data)} --split {record.get('split')}" if data else "synthetic"
    return f"{what}, --seq-length {record.get('seq_length')}, --seed {record.get('seed')}"


def _token_id_problem(args: TrainSettings) -> str | None:
    """A token id at or beyond the model's vocabulary in any ``--data-path`` file, named."""
    prefixes, _ = parse_data_path(args.data_path)
    for prefix in prefixes:
        files = check_prefix(prefix)
        if int(np.iinfo(files.dtype).max) < args.vocab_size:
            continue  # the file's type cannot hold an id that large
        largest = largest_token_id(files)
        if largest >= args.vocab_size:
            return (
                f"--data-path {prefix}: token id {largest} is beyond the model's vocabulary of "
                f"{args.vocab_size}; the data was prepared with another tokenizer (prepare it "
                "again with --tokenizer-model of this model)"
            )
    return None


@dataclass
class _Layout:
    packed: bool
    note: str | None


def _layout(args: TrainSettings, config, parsed, on_gpu: bool) -> _Layout:
    """Packed where asked (``--packed``, or by default for ``--data-path`` on GPUs) and where
    every layer type packs; the reason when it cannot."""
    requested = args.packed
    want = bool(args.data_path) and on_gpu if requested is None else requested
    if not want:
        return _Layout(False, None)
    symbols = {symbol for symbol, count in parsed.layer_counts.items() if count}
    reason = thd_unsupported_reason_for(symbols, config)
    return _Layout(reason is None, f"padded rows instead of packed: {reason}" if reason else None)


class RunInputs:
    """The data of one ``train`` run, laid out into micro-batches.

    Args:
        args: the resolved settings (:func:`resolve_data`).
        config: the model's ``TransformerConfig``.
        pg: its process groups.
        parsed: the parsed pattern.
        global_batch: samples per step.
        device: where micro-batches go.
        on_gpu: whether the run is on GPUs (packing is the default there).

    Raises:
        SettingsError: a token id of the data beyond the vocabulary (checked on rank 0, every
            rank raises).
    """

    def __init__(
        self, args: TrainSettings, config, pg, parsed, *, global_batch: int, device, on_gpu: bool
    ):
        self.args, self.pg, self.global_batch, self.device = args, pg, global_batch, device
        self.padding = padding_config_from(config, pg)
        seq_length = args.seq_length
        if self.padding.fixed_length_required:
            seq_length = self.padding.align_seq_length(
                seq_length,
                micro_batch_size=args.micro_batch_size,
                force_policy="round_up" if args.round_up_seq_length else "raise",
            )
        self.seq_length = seq_length
        layout = _layout(args, config, parsed, on_gpu)
        self.packed, self.layout_note = layout.packed, layout.note
        # Variable row lengths (the synthetic data's; Megatron-LM's samples are all seq_length)
        # take few shapes on GPUs; on the CPU nothing is specialised to a shape.
        self.row_bucket: int | None = None
        if on_gpu and not self.packed and not self.padding.fixed_length_required:
            multiple = self.padding.divisible_by(args.micro_batch_size)
            self.row_bucket = row_length_bucket(seq_length, multiple)
        self.train = self.valid = None
        self.token_budget: int | None = None
        self._check_token_ids()

    @property
    def has_data(self) -> bool:
        return bool(self.args.data_path)

    def _check_token_ids(self) -> None:
        if not self.has_data:
            return
        verdict = [_token_id_problem(self.args) if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise SettingsError(verdict[0])

    def open(self, *, consumed: int, start: int, evaluate: bool) -> None:
        """Build the train split for the samples the run still draws (and the validation
        split's ``--eval-iters`` global batches); fix the packed token budget."""
        args = self.args
        remaining = (args.train_iters - start) * self.global_batch
        valid = args.eval_iters * self.global_batch
        if self.has_data:
            self.train, self.valid = self._gpt(consumed + remaining, valid)
        else:
            tokens = SyntheticTokens(args.vocab_size, max_length=self.seq_length, seed=args.seed)
            documents = args.synthetic_samples == "documents"
            self.train = SyntheticSamples(tokens, "train", documents)
            self.valid = SyntheticSamples(tokens, "valid", documents)
        if evaluate and self.valid is None:
            raise SettingsError(
                f"--eval-interval needs a validation split, but --split "
                f"{args.split or DEFAULT_SPLIT} gives it no data: e.g. --split 98,2,0"
            )
        if self.packed:
            most = max(s.max_documents_per_sample for s in (self.train, self.valid) if s)
            self.token_budget = packed_token_budget(
                self.padding,
                micro_batch_size=args.micro_batch_size,
                seq_length=self.seq_length,
                max_documents=most,
            )

    def _gpt(self, train_samples: int, valid_samples: int):
        args = self.args
        blend = parse_data_path(args.data_path)
        split = args.split or DEFAULT_SPLIT
        config = gpt_dataset_config(
            blend=blend,
            split=split,
            seq_length=self.seq_length,
            seed=args.seed,
            tokenizer=megatron_tokenizer(args.tokenizer_model),
            path_to_cache=args.data_cache_path,
        )
        sizes = [train_samples, valid_samples, valid_samples]
        train, valid, _ = build_gpt_datasets(config, sizes)
        if train is None:
            raise SettingsError(f"--split {split} gives the training split no data")
        files = [check_prefix(p) for p in blend[0]]
        weights = blend[1]
        if weights:
            total = sum(weights)
            shares = ", ".join(f"{w / total:.0%} {p}" for w, p in zip(weights, blend[0],
                                                                        strict=True))  # fmt: skip
        else:
            shares = ", ".join(blend[0])
        name = f"{shares} ({describe_size(files)}; split {split})"
        return (
            GPTSamples(train, f"{name}: samples of {self.seq_length} tokens"),
            GPTSamples(valid, f"{name} validation") if valid is not None else None,
        )

    def micro_batches(self, source, first: int, count: int) -> list[dict]:
        """This rank's ``count`` micro-batches of the global batch that starts at sample
        ``first`` of ``source``."""
        mbs = self.args.micro_batch_size
        base = first + self.pg.dp.rank() * count * mbs
        batches = []
        for m in range(count):
            samples = [source.sample(base + m * mbs + b) for b in range(mbs)]
            batches.append(self._build(samples).to(self.device).step_inputs())
        return batches

    def _build(self, samples):
        if self.packed:
            return build_micro_batch(
                samples,
                self.padding,
                packed=True,
                fixed_length=self.token_budget,
                equalize_group=self.pg.tp_ep,
            )
        fixed = self.seq_length if self.padding.fixed_length_required else None
        bucket = self._bucketed(max(s.length for s in samples)) if self.row_bucket else None
        return build_micro_batch(
            samples,
            self.padding,
            packed=False,
            fixed_length=fixed,
            equalize_group=self.pg.tp_ep,
            min_length=bucket,
        )

    def _bucketed(self, longest: int) -> int | None:
        """The row length of a micro-batch whose longest sample is ``longest`` (None: the
        longest aligned, where the top bucket would pass the model's positions)."""
        bucket = self.row_bucket
        length = -(-longest // bucket) * bucket
        top = -(-self.seq_length // bucket) * bucket
        most = self.args.max_position_embeddings or top
        return length if length <= most else None

    @property
    def step_shape(self) -> tuple[int, int]:
        """``(seq_length, micro_batch_size)`` the pipeline schedule sizes its buffers with:
        one ``[1, T]`` row packed, ``[mbs, S]`` rows padded."""
        if self.packed:
            return self.token_budget, 1
        return self.seq_length, self.args.micro_batch_size

    def describe(self) -> str:
        """``data: WHAT | LAYOUT``: the start-up line about the data."""
        mbs = self.args.micro_batch_size
        if self.packed:
            layout = (
                f"packed: THD micro-batches of {self.token_budget:,} tokens ({mbs} samples, "
                "documents apart)"
            )
        else:
            layout = f"padded rows: {mbs} x {self.seq_length}"
            if self.has_data:
                layout += " (documents share a row, as in Megatron-LM)"
            else:
                layout += " at most (each sequence one row)"
            if self.row_bucket:
                layout += f", lengths a multiple of {self.row_bucket}"
        lines = [f"data: {self.train.describe()} | {layout}"]
        if self.layout_note:
            lines.append(f"--packed: {self.layout_note}")
        return "\n".join(lines)


class StepFeed:
    """The training micro-batches of consecutive steps, the next step's built while a step runs.

    ``train`` hands :meth:`build_next` to ``train_step`` as ``while_queued``: the host builds the
    next step's micro-batches once the step's work is queued on the device, and the step's time
    counts them (as Megatron-LM's iteration time counts its data loading). A failure there is
    the next step's: :meth:`take` raises it, after this step has been logged and saved.

    Args:
        fetch: ``first sample -> micro-batches`` of the step whose global batch starts there.
        first: the first sample of the next step.
        step: samples per step (the global batch).
    """

    def __init__(self, fetch: Callable[[int], list[dict]], first: int, step: int):
        self._fetch, self._first, self._step = fetch, first, step
        self._ready: list[dict] | Exception | None = None

    def build_next(self) -> None:
        """Build the next step's micro-batches now (a failure is kept for :meth:`take`)."""
        try:
            self._ready = self._fetch(self._first)
        except Exception as error:  # re-raised unchanged by take()
            self._ready = error

    def take(self) -> list[dict]:
        """The next step's micro-batches (built now where :meth:`build_next` did not run).

        Raises:
            Exception: what building them raised.
        """
        ready, self._ready = self._ready, None
        if ready is None:
            ready = self._fetch(self._first)
        if isinstance(ready, Exception):
            raise ready
        self._first += self._step
        return ready

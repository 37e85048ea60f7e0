"""The ``logprobs`` command's work: per-token log-probs of JSONL token sequences under a model.

The model comes from ``--load-hf`` (a Hugging Face folder, with ``--load-peft`` a PEFT adapter
on it, read as peft reads it), or ``--load``: a checkpoint that ``convert --from-hf`` or
``train`` wrote (a ``train`` checkpoint's recorded settings give the model; model flags given
must agree with them), or a LoRA run of ``train`` (its recorded base, checked by fingerprint,
with its adapters). It is built on the parallel layout the flags give, like ``train`` builds
it. Each data-parallel replica scores its share of the sequences with
:func:`~megatron_hybrid.logprobs.forward_logprobs` over the model's real vocabulary (a
checkpoint's recorded one: padding rows left out); rank 0 writes one JSON line per input line,
in input order: ``{"logprobs": [...]}`` (and ``"entropies"``), where entry ``j`` is
``log p(input_ids[j + 1] | input_ids[: j + 1])``, the prompt log-probs inference engines report
for every token but the first.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.checkpointing import store
from megatron_hybrid.checkpointing.outputs import Output, check_output
from megatron_hybrid.hf.dist import load_model_state
from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.logprobs import forward_logprobs
from megatron_hybrid.logprobs.forward import real_vocab_size
from megatron_hybrid.pattern import parse_pattern
from megatron_hybrid.peft.checkpoint import load_adapter_state, lora_sharded_state
from megatron_hybrid.process_groups import init_world
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.training.arguments import PATTERN_REQUIRED
from megatron_hybrid.training.checkpoint import apply_recorded_vocab
from megatron_hybrid.training.hf_source import hf_source
from megatron_hybrid.training.lora import lora_run
from megatron_hybrid.training.recorded import recorded_settings_of
from megatron_hybrid.training.resume import prepare_resume
from megatron_hybrid.training.run import (
    build_chunks,
    check_resume_compatible,
    model_config,
    parallel_setup,
)
from megatron_hybrid.training.train_settings import TrainSettings, require_settings
from megatron_hybrid.training.validation import validate_settings

__all__ = ["LogprobsJob", "read_sequences", "replica_share", "run_logprobs"]

#: Token ids are int64 in the model; a larger one can be no vocabulary's.
_MAX_ID = (1 << 63) - 1


@dataclass(frozen=True)
class LogprobsJob:
    """What ``logprobs`` scores and where the results go (its own flags; the model's are
    :class:`~megatron_hybrid.training.train_settings.TrainSettings`).

    Attributes:
        input: the JSONL file of ``{"input_ids": [...]}`` lines (``--input``).
        output: the JSONL file to write (``--output``; None: standard output).
        entropy: also write per-token entropies (``--entropy``).
        temperature: the sampling temperature of the log-probs (``--temperature``).
        max_tokens_per_micro_batch: tokens per forward pass (``--max-tokens-per-micro-batch``).
        overwrite: replace a non-empty ``--output`` (``--overwrite``).
    """

    input: str
    output: str | None
    entropy: bool
    temperature: float
    max_tokens_per_micro_batch: int
    overwrite: bool = False


def read_numbered(path) -> list[tuple[int, list[int]]]:
    """``(line number, input_ids)`` of every non-blank line of a JSONL file.

    Raises:
        ValueError: the file cannot be read, is empty, or a line is not UTF-8, not JSON or not
            ``{"input_ids": [int, ...]}`` with at least one id in [0, 2**63) (the message names
            the file and line).
    """
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {file}: {error.strerror or error}") from None
    numbered = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{file} line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{where} is not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start} "
                "of the line); write the JSONL "
                "file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not JSON: {error.msg}") from None
        ids = record.get("input_ids") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ValueError(f'{where} must be {{"input_ids": [token ids >= 0, ...]}}')
        if not ids:
            raise ValueError(f"{where} has no tokens; every sequence needs at least one")
        big = max(ids)
        if big > _MAX_ID:
            raise ValueError(
                f"{where} holds token id {big}, beyond any vocabulary (ids are 64-bit)"
            )
        numbered.append((number, ids))
    if not numbered:
        raise ValueError(f"{file} holds no sequences; write one JSON object per line")
    return numbered


def read_sequences(path) -> list[list[int]]:
    """The ``input_ids`` of every line of a JSONL file (see :func:`read_numbered`)."""
    return [ids for _, ids in read_numbered(path)]


def replica_share(count: int, dp: int, dp_rank: int) -> list[int]:
    """Indices of the sequences data-parallel replica ``dp_rank`` of ``dp`` scores (may be none:
    with fewer sequences than replicas some replicas only join the collectives)."""
    return list(range(dp_rank, count, dp))


def _checkpoint_settings(args: TrainSettings, where) -> TrainSettings:
    """The model settings of a ``--load`` checkpoint (its record, or its tensors' shapes) in
    the flags not given; given flags that the record contradicts are refused."""
    try:
        target = store.resolve_checkpoint_dir(where)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None
    settings = recorded_settings_of(args, target)
    if settings.differ:
        raise ValueError(
            f"--load {where} records another model than the flags give: "
            f"{'; '.join(settings.differ)}; drop those flags (the checkpoint's settings are "
            "used)"
        )
    if not settings.recorded:
        raise ValueError(f"{PATTERN_REQUIRED}: --load {where} records no layer pattern")
    return settings.args


def _model_args(args: TrainSettings, lora, longest: int) -> tuple[TrainSettings, object]:
    """``(args, source)``: the flags with the model's settings (a Hugging Face config's, a
    checkpoint's record, or the flags'), and the Hugging Face source if any."""
    source = lora.source() if lora is not None else hf_source(args)
    if source is not None:
        args = source.applied_to(args)  # refuses model flags the config decides otherwise
    elif args.load is not None:  # a train checkpoint, or a LoRA run on a torch_dist base
        args = _checkpoint_settings(args, args.load)
    # Only learned absolute positions need a length; a checkpoint records theirs.
    return dataclasses.replace(args, seq_length=longest), source


def _load_weights(args: TrainSettings, chunks, source, lora, rank: int) -> None:
    """What ``build_chunks`` did not load: a ``train`` checkpoint's model weights (checked
    against the model first) or a LoRA run's adapters; and a recorded real vocabulary."""
    if lora is not None:
        if lora.resumed is None:
            return  # --load-peft: load_peft_adapter filled the adapters
        target = prepare_resume(args.load, None)
        load_adapter_state(chunks, store.read(target.folder, lora_sharded_state(chunks)))
        where = f"adapters of {target.folder} on {lora.hf_path or lora.checkpoint}"
    else:
        if source is not None and not source.resumed:
            return  # build_chunks loaded the Hugging Face weights (or the converted checkpoint's)
        try:
            target = prepare_resume(args.load, None)
        except FileNotFoundError as error:
            raise ValueError(str(error)) from None
        if target.folder is None:
            raise ValueError(f"--load {args.load} holds no checkpoint")
        check_resume_compatible(chunks, target.folder, args)
        where = str(load_model_state(chunks, target.folder))
        apply_recorded_vocab(chunks, target.folder)
    if rank == 0:
        print(f"loaded {where}", file=sys.stderr, flush=True)


def _check_ids(numbered, file, vocab: int) -> None:
    """Refuse, naming the line, a token id the model's vocabulary does not have."""
    for number, ids in numbered:
        big = max(ids)
        if big >= vocab:
            raise ValueError(
                f"{file} line {number} holds token id {big}, outside the model's vocabulary "
                f"[0, {vocab})"
            )


def run_logprobs(args: TrainSettings, job: LogprobsJob, backend=None) -> list:
    """Score the sequences of ``job.input``; return this rank's view of all results.

    Args:
        args: the model's settings (the flags ``logprobs`` takes; the others ``train``'s
            defaults).
        job: what to score and where the results go.
        backend: where to run (the CLI passes its choice).

    Returns:
        One ``{"logprobs": [...]}`` (and ``"entropies"``) dict per input sequence, in input
        order (every rank returns them; rank 0 also writes them).
    """
    import torch

    args = require_settings(args, "run_logprobs")
    numbered = read_numbered(job.input)  # before any process group or model exists
    sequences = [ids for _, ids in numbered]
    if args.load_peft and not args.load_hf:
        raise ValueError(
            f"--load-peft {args.load_peft} applies a PEFT adapter to its base: add --load-hf "
            "HF_DIR, the Hugging Face model it was made for (a LoRA run of train is scored with "
            "--load RUN alone)"
        )
    if args.load_hf is None and args.load is None:
        raise ValueError("logprobs scores a trained model: give --load-hf HF_DIR or --load CKPT")
    if job.output is not None:  # before any scoring, not after it
        check_output(job.output, **_output_rules(args, job))
    lora = lora_run(args)  # --load-hf with --load-peft, or --load of a LoRA run
    args, source = _model_args(args, lora, max(len(s) for s in sequences))
    validate_settings(args, scopes=("model", "device", "parallel"))
    backend = backend or select_backend()
    config = model_config(args, source, backend)
    backend.activate()
    rank, world = init_world()
    pg, _, _ = parallel_setup(args, config, world)
    parsed = parse_pattern(args.hybrid_layer_pattern)
    chunks = build_chunks(args, config, pg, parsed, source, args.seq_length, rank, lora=lora)
    _load_weights(args, chunks, source, lora, rank)
    _check_ids(numbered, job.input, real_vocab_size(model_chunks(chunks)[0]))

    # Every data-parallel replica scores its share; the replicas then swap their results.
    dp, dp_rank = pg.dp.size(), pg.dp.rank()
    mine = replica_share(len(sequences), dp, dp_rank)
    # A replica without a share still joins the collectives (expert parallelism spans the
    # replicas): it scores one placeholder token, which predicts nothing and runs no micro-batch.
    batch = [torch.tensor(sequences[i]) for i in mine] or [torch.zeros(1, dtype=torch.long)]
    results = forward_logprobs(
        chunks,
        batch,
        max_tokens_per_micro_batch=job.max_tokens_per_micro_batch,
        temperature=job.temperature,
        with_entropy=job.entropy,
    )
    logprobs, entropies = results if job.entropy else (results, None)
    local = []
    for k, i in enumerate(mine):
        record = {"logprobs": logprobs[k].tolist()}
        if entropies is not None:
            record["entropies"] = entropies[k].tolist()
        local.append((i, record))
    gathered = [None] * dp
    torch.distributed.all_gather_object(gathered, local, group=pg.dp)
    records = dict(pair for part in gathered for pair in part)
    ordered = [records[i] for i in range(len(sequences))]
    lines = "".join(json.dumps(record) + "\n" for record in ordered)
    if job.output is None:
        if rank == 0:
            sys.stdout.write(lines)
            sys.stdout.flush()
        return ordered
    with Output(job.output, **_output_rules(args, job)) as output:  # every rank: rank 0 writes
        if output.first:
            output.run(output.path.write_text, lines, encoding="utf-8")
    if rank == 0:
        _report(ordered, job.output)
    return ordered


def _output_rules(args: TrainSettings, job: LogprobsJob) -> dict:
    """How ``--output`` is checked and written: a file, never one of the command's sources."""
    sources = {"--input": job.input, "--load-hf": args.load_hf, "--load": args.load}
    return dict(kind="file", overwrite=job.overwrite, sources=sources, flag="--output")


def _report(records: list[dict], output) -> None:
    scored = sum(len(r["logprobs"]) for r in records)
    total = sum(sum(r["logprobs"]) for r in records)
    mean = total / scored if scored else float("nan")
    print(
        f"wrote {len(records)} sequences ({scored} log-probs, mean {mean:.4f}) to {output}",
        flush=True,
    )

"""The ``logprobs`` command's work: per-token log-probs of JSONL token sequences under a model.

The model comes from ``--load-hf`` (a Hugging Face folder), or ``--load`` (a checkpoint that
``convert --from-hf`` or ``train`` wrote), built on the parallel layout the flags give, like
``train`` builds it. Each data-parallel replica scores its share of the sequences with
:func:`~megatron_hybrid.logprobs.forward_logprobs`; rank 0 writes one JSON line per input line,
in input order: ``{"logprobs": [...]}`` (and ``"entropies"``), where entry ``j`` is
``log p(input_ids[j + 1] | input_ids[: j + 1])``, the prompt log-probs inference engines report
for every token but the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_hybrid.hf.dist import load_model_state
from megatron_hybrid.logprobs import forward_logprobs
from megatron_hybrid.pattern import parse_pattern
from megatron_hybrid.process_groups import init_world
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.training.hf_source import hf_source
from megatron_hybrid.training.resume import prepare_resume
from megatron_hybrid.training.run import (
    build_chunks,
    check_resume_compatible,
    model_config,
    parallel_setup,
)
from megatron_hybrid.training.validation import validate_settings

__all__ = ["read_sequences", "replica_share", "run_logprobs"]


def read_sequences(path) -> list[list[int]]:
    """The ``input_ids`` of every line of a JSONL file.

    Raises:
        ValueError: the file cannot be read, is empty, or a line is not ``{"input_ids": [int,
            ...]}`` with at least one id (the message names the line).
    """
    file = Path(path)
    try:
        lines = file.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read {file}: {error.strerror or error}") from None
    sequences = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
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
        sequences.append(ids)
    if not sequences:
        raise ValueError(f"{file} holds no sequences; write one JSON object per line")
    return sequences


def replica_share(count: int, dp: int, dp_rank: int) -> list[int]:
    """Indices of the sequences data-parallel replica ``dp_rank`` of ``dp`` scores (may be none:
    with fewer sequences than replicas some replicas only join the collectives)."""
    return list(range(dp_rank, count, dp))


def _load_weights(args, chunks, source, rank: int) -> None:
    """A ``train`` checkpoint's model weights (no optimizer), checked against the model first."""
    if source is not None and not source.resumed:
        return  # build_chunks loaded the Hugging Face weights (or the converted checkpoint's)
    try:
        target = prepare_resume(args.load, None)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None
    if target.folder is None:
        raise ValueError(f"--load {args.load} holds no checkpoint")
    check_resume_compatible(chunks, target.folder, args)
    folder = load_model_state(chunks, target.folder)
    if rank == 0:
        print(f"loaded {folder}", file=sys.stderr, flush=True)


def run_logprobs(args: argparse.Namespace, backend=None) -> list:
    """Score the sequences of ``args.input``; return this rank's view of all results.

    Returns:
        One ``{"logprobs": [...]}`` (and ``"entropies"``) dict per input sequence, in input
        order (every rank returns them; rank 0 also writes them).
    """
    import torch

    sequences = read_sequences(args.input)  # before any process group or model exists
    if args.load_hf is None and args.load is None:
        raise ValueError("logprobs scores a trained model: give --load-hf HF_DIR or --load CKPT")
    source = hf_source(args)  # the architecture of --load-hf or a converted checkpoint
    if source is not None:
        args = source.applied_to(args)
    validate_settings(args, scopes=("model", "device", "parallel"))
    backend = backend or select_backend()
    config = model_config(args, source, backend)
    backend.activate()
    rank, world = init_world()
    pg, _, _ = parallel_setup(args, config, world)
    parsed = parse_pattern(args.hybrid_layer_pattern)
    chunks = build_chunks(args, config, pg, parsed, source, args.seq_length, rank)
    _load_weights(args, chunks, source, rank)

    # Every data-parallel replica scores its share; the replicas then swap their results.
    dp, dp_rank = pg.dp.size(), pg.dp.rank()
    mine = replica_share(len(sequences), dp, dp_rank)
    # A replica without a share still joins the collectives (expert parallelism spans the
    # replicas): it scores one placeholder token, which predicts nothing and runs no micro-batch.
    batch = [torch.tensor(sequences[i]) for i in mine] or [torch.zeros(1, dtype=torch.long)]
    results = forward_logprobs(
        chunks,
        batch,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        temperature=args.temperature,
        with_entropy=args.entropy,
    )
    logprobs, entropies = results if args.entropy else (results, None)
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
    if rank == 0:
        _write(ordered, args.output)
    return ordered


def _write(records: list[dict], output) -> None:
    lines = "".join(json.dumps(record) + "\n" for record in records)
    if output is None:
        sys.stdout.write(lines)
        sys.stdout.flush()
        return
    Path(output).write_text(lines)
    scored = sum(len(r["logprobs"]) for r in records)
    total = sum(sum(r["logprobs"]) for r in records)
    mean = total / scored if scored else float("nan")
    print(
        f"wrote {len(records)} sequences ({scored} log-probs, mean {mean:.4f}) to {output}",
        flush=True,
    )

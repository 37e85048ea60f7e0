"""What ``train --save DIR`` may write into, decided before the first step.

A save root holds the checkpoints of one run. Every ``train`` checkpoint records its run's
identity in the common record (:data:`RUN_KEY`: minted when a run starts from scratch, carried
on by every resume), next to the model settings. Before training, rank 0 compares ``DIR`` with
this run and every rank gets the verdict:

* the checkpoints of this run (a resume into its own root), an empty or missing ``DIR``, or one
  with only leftovers of interrupted saves and a run log (``metrics.jsonl`` of a run killed
  before its first save, whose records a run from scratch drops): saved into as usual, except
  that an iteration folder this run would write again is refused unless ``--overwrite``
  replaces it;
* anything else, that is another run's checkpoints (another model's, or the same model's from
  another start), a converted checkpoint (``convert --from-hf``), or files that are no
  checkpoint: refused, naming what differs, unless ``--overwrite``; then the first save
  replaces all of ``DIR`` (the store's ``replace_root``: written beside it and moved in whole),
  so the two runs are never mixed and the old contents stay until the new checkpoint is
  complete.

Checkpoints of older versions record no run identity: they count as this run's when their model
settings equal this run's (as every version before accepted them).

``DIR`` may never be one of the run's sources (``--load-hf``, ``--load-base``, ``--load-peft``,
a LoRA run's recorded base, a converted checkpoint it starts from, the Hugging Face folder a
checkpoint it starts from records), ``--overwrite`` or not.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.checkpointing.outputs import check_output, is_leftover
from megatron_hybrid.checkpointing.store import (
    INCOMPLETE_DIR,
    LOG_FILES,
    RELEASE,
    TRACKER_FILE,
    CheckpointDamagedError,
    common_record,
    iteration_folders,
    on_first_rank,
    read_common,
    read_record,
    read_tracker,
    resolve_load,
)
from megatron_hybrid.hf.dist import read_hf_record
from megatron_hybrid.peft.checkpoint import LORA_RECORD
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = ["RUN_KEY", "SaveTarget", "check_save_sources", "decide_save_target", "run_of"]

#: Key of the run's identity in a ``train`` checkpoint's common record (``COMMON_RECORD``).
RUN_KEY = "run"


class SaveTargetError(ValueError):
    """``--save`` may not be written as asked; printed as one message (exit code 2)."""


@dataclass(frozen=True)
class SaveTarget:
    """How this run saves.

    Attributes:
        run: this run's identity (recorded in every checkpoint it writes).
        replace_root: the first save replaces everything ``--save`` holds (``--overwrite`` over
            another run's folder).
    """

    run: str
    replace_root: bool = False


def run_of(folder) -> str | None:
    """The run identity a checkpoint records (None: written before runs had one)."""
    return common_record(read_common(folder)).get(RUN_KEY)


def check_save_sources(args: TrainSettings, lora=None, source=None) -> None:
    """Refuse, before any work, a ``--save`` that is a file, cannot be written, or overlaps a
    source of the run (always, ``--overwrite`` or not).

    Raises:
        OutputError: naming the flag and the source.
    """
    if not args.save:
        return
    recorded = getattr(source, "checkpoint", None) or getattr(source, "recorded_in", None)
    sources = {
        "--load-hf": args.load_hf,
        "--load-base": args.load_base,
        "--load-peft": args.load_peft,
        "the LoRA run's base": None if lora is None else lora.hf_path or lora.checkpoint,
        "the converted checkpoint the run starts from": getattr(source, "checkpoint", None),
        "the Hugging Face folder the model came from": (
            read_hf_record(recorded).get("hf_path") if recorded else None
        ),
    }
    # overwrite=True: whether a non-empty DIR may be written is decided against its contents.
    check_output(args.save, overwrite=True, sources=sources, flag="--save")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _differences(record: dict, settings: dict, lora: bool, folder: Path) -> list[str]:
    """What the checkpoint's run has that this one has not (model settings, LoRA)."""
    differ = []
    pattern = record.get("hybrid_layer_pattern")
    if pattern is not None and pattern != settings.get("hybrid_layer_pattern"):
        differ.append(f"pattern {pattern} (this run: {settings.get('hybrid_layer_pattern')})")
    recorded = record.get("model") or {}
    for dest, value in recorded.items():
        if dest != "hybrid_layer_pattern" and dest in settings and settings[dest] != value:
            differ.append(f"{_flag(dest)} {value} (this run: {settings[dest]})")
    theirs = read_record(folder, LORA_RECORD) is not None
    if theirs != lora:
        differ.append(
            "LoRA adapters (this run: a full model)" if theirs else "a full model (this run: LoRA)"
        )
    return differ


def _foreign(root: Path, run: str, resumed, settings: dict, lora: bool) -> tuple[str, str] | None:
    """What ``root`` holds that is not this run's checkpoints, and how else to go on (None:
    nothing)."""
    if not root.is_dir():
        return None
    elsewhere = "save into another folder"
    known = {RELEASE, TRACKER_FILE, INCOMPLETE_DIR}
    known |= {p.name for p in iteration_folders(root).values()}
    # The run log (metrics.jsonl, loss curve) describes the checkpoints beside it: with none, it
    # is the log of a run killed before its first save, which a run from scratch starts anew.
    others = sorted(
        p.name
        for p in root.iterdir()
        if p.name not in known and not is_leftover(p.name) and not p.name.startswith(LOG_FILES)
    )
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return f"files that are no checkpoint of this run ({shown})", elsewhere
    tracker = root / TRACKER_FILE
    try:
        named = read_tracker(tracker) if tracker.is_file() else None
    except CheckpointDamagedError:
        named = None  # resolving the root names the damage below
    if (root / RELEASE).exists() or named == RELEASE:
        what = "a converted checkpoint (convert --from-hf: weights only)"
        return what, f"train from it with --load {root} and {elsewhere}"
    try:
        folder = resolve_load(root).folder
    except (FileNotFoundError, CheckpointDamagedError) as error:
        return f"something that is no readable checkpoint ({error})", elsewhere
    if folder is None:
        return None  # only leftovers of interrupted saves
    if resumed is not None and Path(resumed).resolve() == folder.resolve():
        return None
    try:
        record = common_record(read_common(folder))
    except CheckpointDamagedError as error:
        return f"a checkpoint that cannot be read ({error})", elsewhere
    theirs = record.get(RUN_KEY)
    if theirs is not None and theirs == run:
        return None
    differ = _differences(record, settings, lora, folder)
    if differ:
        return f"the checkpoints of another model ({'; '.join(differ[:4])}) in {folder}", elsewhere
    if theirs is None:
        return None  # an older version's checkpoint of this model: as before
    start = f"resumes {resumed}" if resumed is not None else "starts from scratch"
    what = (
        f"the checkpoints of another run of the same model ({folder}; this run {start}, it does "
        "not continue that one)"
    )
    return what, f"resume that run with --load {root}, or {elsewhere}"


def _decide(args: TrainSettings, start: int, resumed, settings: dict, lora: bool) -> SaveTarget:
    run = (run_of(resumed) if resumed is not None else None) or uuid.uuid4().hex
    if not args.save:
        return SaveTarget(run)
    root = Path(args.save)
    foreign = _foreign(root, run, resumed, settings, lora)
    if foreign is not None:
        if args.overwrite:
            return SaveTarget(run, replace_root=True)
        what, advice = foreign
        raise SaveTargetError(
            f"--save {root} holds {what}: saving there would mix two runs (its tracker would "
            f"name this run's checkpoints); {advice}, or pass --overwrite to replace what it "
            "holds (at this run's first save)"
        )
    if args.overwrite:
        return SaveTarget(run)
    planned = {args.train_iters} | (
        set(range(args.save_interval, args.train_iters + 1, args.save_interval))
        if args.save_interval
        else set()
    )
    clash = sorted(i for i in iteration_folders(root) if i in planned and i > start)
    if clash:
        raise SaveTargetError(
            f"--save {root} already holds iteration(s) {clash} that this run would write; pass "
            "--overwrite to replace them or choose another --save"
        )
    return SaveTarget(run)


def decide_save_target(
    args: TrainSettings, start: int, resumed, settings: dict, *, lora: bool
) -> SaveTarget:
    """Decide how this run saves, before training (collective: rank 0 reads, all get it).

    Args:
        args: the run's effective settings (``--save``, ``--overwrite``, the save schedule).
        start: the iteration the run starts at.
        resumed: the checkpoint folder the run resumed from (None: it starts from scratch or
            from weights only).
        settings: the model settings this run records (``recorded_settings``), with its
            pattern.
        lora: whether this run trains LoRA adapters.

    Raises:
        SaveTargetError: ``--save`` holds another run's checkpoints, a converted checkpoint or
            other files, and ``--overwrite`` is not given; or iteration folders this run would
            write again.
    """
    # A damaged checkpoint (CheckpointDamagedError) is rank 0's error too: every rank raises it.
    return on_first_rank(lambda: _decide(args, start, resumed, settings, lora))

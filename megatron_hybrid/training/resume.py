"""Where a run resumes from, decided before training, and what it must not do.

Restarting the same command after a crash must work without a human: a save that was killed
leaves an iteration folder without ``metadata.json`` (megatron-core writes it last), which is not
a checkpoint. :func:`prepare_resume` moves such leftovers of ``--save`` into its ``incomplete/``
folder (kept for inspection, out of the way of the next save), resumes from the newest complete
checkpoint of ``--load``, verifies its files against the integrity manifest, and starts from
scratch when ``--load`` holds no complete checkpoint yet, as Megatron-LM does.

Rank 0 looks at the file system and decides; every rank gets the same decision.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.inspect import TRACKER_FILE, iteration_folder_name
from megatron_hybrid.checkpointing.integrity import (
    CheckpointDamagedError,
    complete_iterations,
    incomplete_iterations,
    is_complete,
    read_tracker,
    verify_checkpoint_files,
)

__all__ = [
    "INCOMPLETE_DIR",
    "ResumePoint",
    "check_target",
    "layout_of",
    "find_resume_folder",
    "prepare_resume",
    "set_aside_incomplete",
]

#: Folder of a save root that receives the leftovers of interrupted saves.
INCOMPLETE_DIR = "incomplete"


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint folder to load (None: start from scratch) and what rank 0 should say."""

    folder: Path | None
    notes: tuple[str, ...] = ()


def set_aside_incomplete(root: str | Path) -> list[tuple[Path, Path]]:
    """Move every incomplete ``iter_*`` folder of a save root to ``root/incomplete/``.

    Returns:
        ``(old, new)`` paths of the moved folders.
    """
    moved = []
    for _, folder in sorted(incomplete_iterations(root).items()):
        target = Path(root) / INCOMPLETE_DIR / folder.name
        suffix = 1
        while target.exists():  # an earlier crash at the same iteration: keep both
            target = target.with_name(f"{folder.name}.{suffix}")
            suffix += 1
        target.parent.mkdir(exist_ok=True)
        shutil.move(str(folder), str(target))
        moved.append((folder, target))
    return moved


def _holds_only_leftovers(path: Path) -> bool:
    """Whether a directory is missing, or holds nothing but interrupted saves."""
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    leftovers = set(incomplete_iterations(path).values())
    return all(p in leftovers or p.name == INCOMPLETE_DIR for p in path.iterdir())


def find_resume_folder(load: str | Path) -> ResumePoint:
    """The newest complete checkpoint of ``--load`` (a save root or an iteration folder).

    The tracker names the checkpoint, except when a complete folder is newer (the tracker is
    written after the folder, so a crash between the two leaves it one save behind) or when the
    folder it names is not complete (a crash while a save replaced it): then the newest complete
    folder is taken.

    Raises:
        FileNotFoundError: ``load`` is not a checkpoint, or its tracker names a missing one.
        CheckpointDamagedError: the tracker is damaged.
    """
    path = Path(load)
    if is_complete(path):
        return ResumePoint(path)
    complete = complete_iterations(path)
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        named = read_tracker(tracker)
        newest = max(complete) if complete else None
        if named != "release" and newest is not None and newest > named:
            note = (
                f"{tracker} names iteration {named}, but {complete[newest]} is a complete, newer "
                "checkpoint (the run stopped before updating the tracker): resuming from it"
            )
            return ResumePoint(complete[newest], (note,))
        folder = path / iteration_folder_name(named)
        if is_complete(folder):
            return ResumePoint(folder)
        if newest is not None:  # e.g. a kill while --overwrite-checkpoint replaced that folder
            note = (
                f"{tracker} names {folder}, which is not a complete checkpoint: resuming from "
                f"the newest complete one, {complete[newest]}"
            )
            return ResumePoint(complete[newest], (note,))
        raise FileNotFoundError(
            f"{tracker} names {folder}, which is not a complete torch_dist checkpoint, and no "
            "iteration folder is complete; restore the checkpoint or delete the tracker to "
            "start from scratch"
        )
    if complete:
        return ResumePoint(complete[max(complete)])
    if _holds_only_leftovers(path):
        leftovers = sorted(incomplete_iterations(path))
        why = f" (only interrupted saves: iterations {leftovers})" if leftovers else ""
        return ResumePoint(None, (f"--load {path} holds no checkpoint yet{why}: starting from "
                                  "scratch",))  # fmt: skip
    raise FileNotFoundError(
        f"--load {path} is not a torch_dist checkpoint: expected a metadata.json in it, a "
        f"{TRACKER_FILE}, or iter_* folders"
    )


def _decide(load, save) -> ResumePoint:
    notes = []
    if save:
        for old, new in set_aside_incomplete(save):
            notes.append(f"{old} is the leftover of an interrupted save, not a checkpoint: "
                         f"moved to {new}")  # fmt: skip
    if not load:
        return ResumePoint(None, tuple(notes))
    point = find_resume_folder(load)
    if point.folder is not None and not verify_checkpoint_files(point.folder):
        notes.append(f"{point.folder} has no integrity manifest: its files are not verified")
    return ResumePoint(point.folder, (*notes, *point.notes))


def prepare_resume(load: str | None, save: str | None) -> ResumePoint:
    """Set aside interrupted saves, pick and verify the checkpoint to load (collective).

    Raises:
        FileNotFoundError, CheckpointDamagedError: on every rank, with rank 0's message.
    """
    payload: list = [None]
    if torch.distributed.get_rank() == 0:
        try:
            payload = [_decide(load, save)]
        except (FileNotFoundError, CheckpointDamagedError) as error:
            payload = [error]
    torch.distributed.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], BaseException):
        raise payload[0]
    return payload[0]


def check_target(iteration: int, train_iters: int, folder) -> None:
    """Refuse a ``--train-iters`` below the iteration a checkpoint was saved at.

    Raises:
        ValueError: with the fix.
    """
    if train_iters < iteration:
        raise ValueError(
            f"--train-iters {train_iters} is below iteration {iteration} of the checkpoint "
            f"{folder}; pass --train-iters {iteration} or more to continue training"
        )


def layout_of(pg_collection) -> dict[str, int]:
    """The parallel sizes a checkpoint records (what a resume may or may not change)."""
    names = {"tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp", "etp": "expt_tp", "dp": "dp"}
    sizes = {}
    for short, name in names.items():
        group = getattr(pg_collection, name, None)  # groups a collection was not given: size 1
        sizes[short] = group.size() if group is not None else 1
    return sizes

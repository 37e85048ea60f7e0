"""Where a run resumes from, decided before training, and what it must not do.

Restarting the same command after a crash must work without a human: a save that was killed
leaves a staging folder beside the iteration folder it was writing (``.iter_*.partial-*``), or,
from versions that wrote in place, an iteration folder without ``metadata.json``; neither is a
checkpoint. :func:`prepare_resume` removes the former and moves the latter into ``--save``'s
``incomplete/`` folder (kept for inspection, out of the way of the next save), resumes from the
checkpoint the store resolves ``--load`` to (``checkpointing.store.resolve_load``), verifies its
files against the integrity manifest, and starts from scratch when ``--load`` holds no complete
checkpoint yet, as Megatron-LM does.

Rank 0 looks at the file system and decides; every rank gets the same decision.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.integrity import CheckpointDamagedError, verify_checkpoint_files
from megatron_hybrid.checkpointing.outputs import recover_all
from megatron_hybrid.checkpointing.store import (
    INCOMPLETE_DIR,
    LoadTarget,
    incomplete_iterations,
    resolve_load,
)

__all__ = [
    "check_target",
    "layout_of",
    "prepare_resume",
    "set_aside_incomplete",
]


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


def _decide(load, save) -> LoadTarget:
    notes = []
    if save:
        # Staging folders of killed saves go; an old iteration folder set aside by a save killed
        # while replacing it comes back (checkpointing/outputs.py).
        notes.extend(recover_all(save))
        for old, new in set_aside_incomplete(save):
            notes.append(f"{old} is the leftover of an interrupted save, not a checkpoint: "
                         f"moved to {new}")  # fmt: skip
    if not load:
        return LoadTarget(None, tuple(notes))
    target = resolve_load(load)
    if target.folder is None:
        # Nothing saved yet (or only interrupted saves): a first run, as Megatron-LM starts.
        return LoadTarget(None, (*notes, *(f"--load {n}: starting from scratch"
                                           for n in target.notes)))  # fmt: skip
    if not verify_checkpoint_files(target.folder):
        notes.append(f"{target.folder} has no integrity manifest: its files are not verified")
    return LoadTarget(target.folder, (*notes, *target.notes))


def prepare_resume(load: str | None, save: str | None) -> LoadTarget:
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

"""The checkpoint folder's names and its listing: which folders of a save root are checkpoints,
and which one a ``--load`` path stands for (no torch).

Part of the checkpoint store: import these names from :mod:`megatron_hybrid.checkpointing.store`,
which re-exports them next to the writer and the reader. The format is described once, in
``docs/architecture.md`` ("The checkpoint folder").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.checkpointing.integrity import CheckpointDamagedError
from megatron_hybrid.checkpointing.outputs import is_leftover

__all__ = [
    "COMMON_RECORD",
    "HF_FILES_DIR",
    "HF_RECORD_FILE",
    "INCOMPLETE_DIR",
    "LOG_FILES",
    "METADATA_FILE",
    "MODEL_ONLY_FORMAT",
    "PER_RANK_FORMAT",
    "RELEASE",
    "TRACKER_FILE",
    "TRAIN_FORMAT",
    "LoadTarget",
    "complete_iterations",
    "incomplete_iterations",
    "is_complete",
    "iteration_folder_name",
    "iteration_folders",
    "read_tracker",
    "resolve_checkpoint_dir",
    "resolve_load",
]

# --- the on-disk names -----------------------------------------------------------------------

#: The save root's tracker: the newest iteration (or ``release``), replaced atomically, last.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: megatron-core's last file of a save: a folder without it is the leftover of a killed save.
METADATA_FILE = "metadata.json"
#: The iteration "name" of a weights-only checkpoint (Megatron-LM's release layout).
RELEASE = "release"
#: Folder of a save root that receives the leftovers of interrupted saves (``train``).
INCOMPLETE_DIR = "incomplete"
#: Files of a save root that describe the run writing it (``train``'s metrics and loss curve;
#: ``training/metrics.py`` writes them, through temporary names that start with these).
LOG_FILES = ("metrics.jsonl", "loss_curve.png")
#: The JSON record of the Hugging Face model a checkpoint holds (``hf/dist.py`` writes it).
HF_RECORD_FILE = "hf_model.json"
#: Subfolder of a checkpoint with the files of its Hugging Face source that serving needs
#: (tokenizer, generation config, chat template), so that ``convert --to-hf`` writes them again.
HF_FILES_DIR = "hf_files"
#: Key of the package's entry in a checkpoint's common state: ``format``, the pattern, and the
#: model settings of a ``train`` checkpoint.
COMMON_RECORD = "megatron_hybrid"
#: Formats (``common[COMMON_RECORD]["format"]``): training state with the CPU optimizer state
#: pickled per rank (loads only on the layout that wrote it) ...
PER_RANK_FORMAT = "megatron_hybrid/1"
#: ... training state with every tensor sharded (``train --save``) ...
TRAIN_FORMAT = "megatron_hybrid/2"
#: ... and model weights only (``convert --from-hf``).
MODEL_ONLY_FORMAT = "megatron_hybrid/model-only/1"

_ITERATION = re.compile(r"iter_(\d+)")


def iteration_folder_name(iteration: int | str) -> str:
    """Megatron-LM's folder of one saved iteration (``iter_0000010``, or ``release``)."""
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def is_complete(folder: str | Path) -> bool:
    """Whether megatron-core finished writing the dist checkpoint in ``folder``."""
    return (Path(folder) / METADATA_FILE).is_file()


def iteration_folders(root: str | Path) -> dict[int, Path]:
    """Iteration -> folder of every ``iter_*`` folder under a save root, complete or not."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for path in root.iterdir():
        match = _ITERATION.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def complete_iterations(root: str | Path) -> dict[int, Path]:
    """Iteration -> folder of every complete checkpoint under a save root."""
    return {i: p for i, p in iteration_folders(root).items() if is_complete(p)}


def incomplete_iterations(root: str | Path) -> dict[int, Path]:
    """Iteration -> folder of every leftover of an interrupted save under a save root."""
    return {i: p for i, p in iteration_folders(root).items() if not is_complete(p)}


def read_tracker(tracker: str | Path) -> int | str:
    """The iteration a tracker file names (an int, or ``"release"``).

    Raises:
        CheckpointDamagedError: the file holds anything else.
    """
    text = Path(tracker).read_text(errors="replace").strip()
    if text == RELEASE:
        return text
    if not text.isdigit():
        raise CheckpointDamagedError(
            f"{tracker} is damaged: it holds {text[:40]!r}, not an iteration number; write the "
            "iteration of a complete iter_* folder into it, or delete it to resume from the "
            "newest complete one"
        )
    return int(text)


@dataclass(frozen=True)
class LoadTarget:
    """The checkpoint folder a ``--load`` path stands for (None: it holds none yet), and notes
    on how it was chosen."""

    folder: Path | None
    notes: tuple[str, ...] = ()


def _holds_only_leftovers(path: Path) -> bool:
    """Whether a directory is missing, or holds nothing but interrupted saves (and the logs of
    the run that made them)."""
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    leftovers = set(incomplete_iterations(path).values())
    return all(
        p in leftovers
        or p.name == INCOMPLETE_DIR
        or is_leftover(p.name)
        or p.name.startswith(LOG_FILES)
        for p in path.iterdir()
    )


def resolve_load(path: str | Path) -> LoadTarget:
    """The newest complete checkpoint of a save root or iteration folder.

    The tracker names the checkpoint, except when a complete folder is newer (the tracker is
    written after the folder, so a crash between the two leaves it one save behind) or when the
    folder it names is not complete (a crash while a save replaced it): then the newest complete
    folder is taken, with a note saying so. A path that is missing or holds only leftovers of
    interrupted saves has no checkpoint yet (``folder`` None).

    Raises:
        FileNotFoundError: ``path`` holds something else, or its tracker names a missing
            checkpoint and no folder is complete.
        CheckpointDamagedError: the tracker is damaged.
    """
    path = Path(path)
    if is_complete(path):
        return LoadTarget(path)
    complete = complete_iterations(path)
    newest = max(complete) if complete else None
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        named = read_tracker(tracker)
        if named != RELEASE and newest is not None and newest > named:
            note = (
                f"{tracker} names iteration {named}, but {complete[newest]} is a complete, newer "
                "checkpoint (the run stopped before updating the tracker): resuming from it"
            )
            return LoadTarget(complete[newest], (note,))
        folder = path / iteration_folder_name(named)
        if is_complete(folder):
            return LoadTarget(folder)
        if newest is not None:  # e.g. a kill while an overwrite replaced that folder
            note = (
                f"{tracker} names {folder}, which is not a complete checkpoint: resuming from "
                f"the newest complete one, {complete[newest]}"
            )
            return LoadTarget(complete[newest], (note,))
        raise FileNotFoundError(
            f"{tracker} names {folder}, which is not a complete torch_dist checkpoint, and no "
            "iteration folder is complete; restore the checkpoint or delete the tracker to "
            "start from scratch"
        )
    if newest is not None:
        return LoadTarget(complete[newest])
    if _holds_only_leftovers(path):
        leftovers = sorted(incomplete_iterations(path))
        why = f" (only interrupted saves: iterations {leftovers})" if leftovers else ""
        return LoadTarget(None, (f"{path} holds no checkpoint yet{why}",))
    raise FileNotFoundError(
        f"{path} is not a torch_dist checkpoint: expected a {METADATA_FILE} in it, a "
        f"{TRACKER_FILE}, or iter_* folders"
    )


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint folder of a save root or iteration folder (:func:`resolve_load`'s choice).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        CheckpointDamagedError: the tracker is damaged.
    """
    target = resolve_load(path)
    if target.folder is None:
        raise FileNotFoundError(
            f"{path} is not a torch_dist checkpoint: expected a {METADATA_FILE} in it, or a "
            f"{TRACKER_FILE} naming an iteration folder"
        )
    return target.folder

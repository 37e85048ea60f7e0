"""The checkpoint folder format: its names, the folder listing, the one writer and the reader.

Every checkpoint folder of the package is written by :func:`write` and read through
:func:`read` (or :func:`read_model_state`); the format is described once, in
``docs/architecture.md`` ("The checkpoint folder"). What a checkpoint *holds* is the business of
its writer: ``training/checkpoint.py`` adds optimizer and RNG state, ``hf/dist.py`` the record of
the Hugging Face model, ``training/resume.py`` decides what a run resumes from.

:func:`write` is atomic in the sense that matters after a crash: a folder counts as a checkpoint
only once megatron-core's ``metadata.json`` is in it, the records are written before that, the
integrity manifest after it, and the tracker last. It refuses NaN and infinite values by name, and
every rank agrees before anything is written.

Writers add what they need through two arguments, without touching this module:

* ``state`` takes any sharded state dict: model tensors, optimizer state, and tensors a writer
  carries that are not model parameters (a vision tower kept bitwise, ...). Carried tensors go
  under keys outside the model's roots (``embedding.``, ``decoder.``, ``output_layer.``,
  ``mtp.``), as ``ShardedTensor`` so that no rank holds them all; every floating tensor is
  checked like the model's. :func:`read` loads them back from a request with the same keys.
* ``records`` takes JSON records, one file each (``hf_model.json``, a LoRA config and base
  fingerprint, a source-format record, ...): readable without torch or the data files, and
  covered by the integrity manifest. :func:`read_record` reads one.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hybrid.checkpointing.integrity import (
    INTEGRITY_FILE,
    CheckpointDamagedError,
    describe_read_error,
    verify_checkpoint_files,
    write_integrity_manifest,
)
from megatron_hybrid.checkpointing.sharded import model_sharded_state

__all__ = [
    "COMMON_RECORD",
    "HF_RECORD_FILE",
    "INCOMPLETE_DIR",
    "INTEGRITY_FILE",
    "METADATA_FILE",
    "MODEL_ONLY_FORMAT",
    "PER_RANK_FORMAT",
    "RELEASE",
    "TRACKER_FILE",
    "TRAIN_FORMAT",
    "CheckpointDamagedError",
    "CheckpointExistsError",
    "LoadTarget",
    "NonFiniteCheckpointError",
    "common_record",
    "complete_iterations",
    "first_nonfinite",
    "incomplete_iterations",
    "is_complete",
    "iteration_folder_name",
    "iteration_folders",
    "nonfinite_on_any_rank",
    "read",
    "read_common",
    "read_model_state",
    "read_record",
    "read_tracker",
    "resolve_checkpoint_dir",
    "resolve_load",
    "tensor_is_finite",
    "verify",
    "write",
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
#: The JSON record of the Hugging Face model a checkpoint holds (``hf/dist.py`` writes it).
HF_RECORD_FILE = "hf_model.json"
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

# Files a record may not replace (megatron-core's and the manifest).
_RESERVED = frozenset({METADATA_FILE, INTEGRITY_FILE, "common.pt", ".metadata"})
_RECORD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.json")
_ITERATION = re.compile(r"iter_(\d+)")


class CheckpointExistsError(FileExistsError):
    """The iteration folder already exists and overwriting was not asked for."""


class NonFiniteCheckpointError(ValueError):
    """A tensor to save or loaded is NaN or infinite; the message names it."""


def iteration_folder_name(iteration: int | str) -> str:
    """Megatron-LM's folder of one saved iteration (``iter_0000010``, or ``release``)."""
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


# --- the folder listing ----------------------------------------------------------------------


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
    """Whether a directory is missing, or holds nothing but interrupted saves."""
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    leftovers = set(incomplete_iterations(path).values())
    return all(p in leftovers or p.name == INCOMPLETE_DIR for p in path.iterdir())


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


# --- records -----------------------------------------------------------------------------------


def read_common(path: str | Path) -> dict:
    """The common state (iteration, :data:`COMMON_RECORD`, ...) of the checkpoint at ``path``."""
    from megatron.core import dist_checkpointing

    folder = resolve_checkpoint_dir(path)
    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    except BaseException as error:  # noqa: BLE001 - torch's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointDamagedError(
            f"cannot read the common state of the checkpoint {folder}: "
            f"{describe_read_error(error)}"
        ) from None
    return dict(common) if isinstance(common, Mapping) else {}


def common_record(common: Mapping) -> dict:
    """The package's entry of a common state ({} for checkpoints of other tools)."""
    record = common.get(COMMON_RECORD)
    return dict(record) if isinstance(record, Mapping) else {}


def read_record(path: str | Path, name: str) -> dict | None:
    """The JSON record ``name`` of the checkpoint at ``path`` (None if it has none).

    Raises:
        CheckpointDamagedError: the record is not a JSON object.
    """
    file = resolve_checkpoint_dir(path) / name
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointDamagedError(f"checkpoint record {file} is damaged ({error})") from None
    if not isinstance(record, dict):
        raise CheckpointDamagedError(f"checkpoint record {file} is damaged (not a JSON object)")
    return record


def _encoded_records(records: Mapping[str, Any] | None) -> dict[str, str]:
    """Records as JSON text, checked before anything is written (on every rank alike)."""
    encoded = {}
    for name, record in (records or {}).items():
        if not _RECORD_NAME.fullmatch(name) or name in _RESERVED:
            raise ValueError(
                f"record name {name!r}: use a plain file name ending in .json other than "
                f"{sorted(n for n in _RESERVED if n.endswith('.json'))}"
            )
        if not isinstance(record, Mapping):
            raise TypeError(f"record {name!r} must be a mapping, not {type(record).__name__}")
        encoded[name] = json.dumps(record, indent=1, sort_keys=True) + "\n"
    return encoded


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


# --- finiteness --------------------------------------------------------------------------------

# float8 types torch.isfinite does not take (e4m3 has NaN but no infinity).
_UPCAST = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def tensor_is_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the tensor's device: no NaN or infinity in it (no host sync)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.dtype in _UPCAST:
        tensor = tensor.float()
    return torch.isfinite(tensor).all()


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or infinity, None if all are finite.

    All flags are reduced before one host synchronisation; the names are looked at only when
    something is not finite.
    """
    items = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    if not items:
        return None
    flags = [tensor_is_finite(t) for _, t in items]
    device = flags[0].device
    finite = torch.stack([f.to(device) for f in flags])
    if bool(finite.all()):
        return None
    return items[int((~finite).nonzero()[0, 0])][0]


def _state_tensors(state, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a (sharded) state dict: checkpoint keys for sharded entries, the
    dotted path for plain tensors; objects (RNG state, pickled values) are not tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(state, (ShardedTensor, ShardedTensorFactory)):
        if isinstance(state.data, torch.Tensor):
            yield state.key, state.data
    elif isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _state_tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _state_tensors(value, f"{path}.{i}" if path else str(i))


def _collective_device(group) -> torch.device | str:
    backend = torch.distributed.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"


def nonfinite_on_any_rank(local: str | None, group=None) -> tuple[str, int] | None:
    """``(name, rank)`` of the lowest rank's non-finite tensor, None if every rank is finite.

    Collective over ``group`` (default: the world). Args: ``local``: this rank's
    :func:`first_nonfinite` result. Names cross ranks only when something is not finite.
    """
    bad = torch.tensor([float(local is not None)], device=_collective_device(group))
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=group)
    if not bad.item():
        return None
    names: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(names, local, group=group)
    rank = next(r for r, name in enumerate(names) if name is not None)
    return names[rank], rank


def _on_first_rank(work: Callable[[], Any], group) -> Any:
    """``work()`` on the group's first rank; every rank returns its result or raises its error."""
    payload: list = [None]
    if torch.distributed.get_rank(group) == 0:
        try:
            payload = [work()]
        except (OSError, ValueError) as error:  # CheckpointDamagedError is a ValueError
            payload = [error]
    torch.distributed.broadcast_object_list(
        payload, src=torch.distributed.get_global_rank(group or _world(), 0), group=group
    )
    if isinstance(payload[0], BaseException):
        raise payload[0]
    return payload[0]


def _world():
    return torch.distributed.group.WORLD


# --- writing -----------------------------------------------------------------------------------


@contextmanager
def _prepared_folder_is_expected():
    """Hide megatron-core's "Overwriting old incomplete / corrupted checkpoint" warning while
    saving into a folder :func:`write` has just emptied and given its records
    (``dist_checkpointing/serialization.py``: ``save`` warns on any non-empty folder)."""
    logger = logging.getLogger("megatron.core.dist_checkpointing.serialization")

    def hide(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Overwriting old incomplete")

    logger.addFilter(hide)
    try:
        yield
    finally:
        logger.removeFilter(hide)


def _in_process_write_results() -> None:
    """Keep megatron-core's synchronous save inside this process (no helper processes).

    megatron-core 0.19.2's ``FileSystemWriterAsync`` (``dist_checkpointing/strategies/
    filesystem_async.py``) hands write results over a queue that it creates on first use with a
    ``spawn`` multiprocessing ``Manager``: a server process, plus spawn's resource tracker, that
    outlive a killed trainer (re-parented to PID 1). A synchronous save writes with threads of
    this process and reads the results back in it, so an in-process queue carries them.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _empty(folder: Path) -> None:
    """Make ``folder`` an empty folder; its completeness markers go first, so that a kill midway
    leaves a leftover, never a checkpoint that looks complete (or verified)."""
    folder.mkdir(parents=True, exist_ok=True)
    for marker in (METADATA_FILE, INTEGRITY_FILE):
        (folder / marker).unlink(missing_ok=True)
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def write(
    root: str | Path,
    iteration: int | str,
    state: dict,
    records: Mapping[str, Mapping] | None = None,
    *,
    overwrite: bool = False,
    group=None,
) -> Path:
    """Save ``state`` as the checkpoint of ``iteration`` under the save root ``root``.

    Collective over ``group`` (default: the world; megatron-core 0.19.2's
    ``dist_checkpointing.save`` runs over the world, so the group must hold every rank). In
    order: every floating tensor of ``state`` is checked (nothing is written if one is NaN or
    infinite anywhere), the ranks agree whether the folder exists, the group's first rank
    empties the folder (when overwriting) and writes the records, megatron-core writes the data
    and then ``metadata.json`` (the folder is complete from here), the first rank writes the
    integrity manifest over every file and only then replaces the tracker.

    Args:
        root: the save root.
        iteration: the iteration (``iter_0000010``), or ``"release"`` for a weights-only
            checkpoint (the root's only one).
        state: the sharded state dict to save (``ShardedTensor``/factories/``ShardedObject``
            entries and common values), as ``dist_checkpointing.save`` takes it.
        records: file name (``*.json``) -> JSON object, written into the folder.
        overwrite: replace an existing folder instead of refusing.
        group: the process group of the ranks saving.

    Returns:
        The iteration folder.

    Raises:
        NonFiniteCheckpointError: a tensor of ``state`` is NaN or infinite (named; nothing is
            written).
        CheckpointExistsError: the folder exists (or, for ``release``, the root holds another
            checkpoint) and ``overwrite`` is False.
        ValueError, TypeError: a record name or value that cannot be written.
    """
    from megatron.core import dist_checkpointing

    if iteration != RELEASE and (isinstance(iteration, bool) or not isinstance(iteration, int)
                                 or iteration < 0):  # fmt: skip
        raise ValueError(f"iteration {iteration!r}: give an int >= 0 or {RELEASE!r}")
    root = Path(root)
    folder = root / iteration_folder_name(iteration)
    encoded = _encoded_records(records)
    found = nonfinite_on_any_rank(first_nonfinite(_state_tensors(state)), group)
    if found is not None:
        name, rank = found
        raise NonFiniteCheckpointError(
            f"not saving {folder}: {name} has NaN or infinite values (rank {rank}); nothing "
            "was written"
        )
    # A release checkpoint repoints the tracker: it may not hide the root's other checkpoints.
    taken = folder.exists() or (iteration == RELEASE and (root / TRACKER_FILE).exists())
    exists = torch.tensor([float(taken)], device=_collective_device(group))
    torch.distributed.all_reduce(exists, op=torch.distributed.ReduceOp.MAX, group=group)
    if exists.item() and not overwrite:
        where = folder if folder.exists() else root
        raise CheckpointExistsError(
            f"{where} already holds a checkpoint; pass --overwrite-checkpoint (Python: "
            "overwrite=True) to replace it or choose another --save directory"
        )
    first = torch.distributed.get_rank(group) == 0
    if first:
        _empty(folder)
        for name, text in encoded.items():
            _write_atomically(folder / name, text)
    torch.distributed.barrier(group=group)
    _in_process_write_results()
    with _prepared_folder_is_expected():
        dist_checkpointing.save(state, str(folder))
    torch.distributed.barrier(group=group)
    if first:
        write_integrity_manifest(folder)
        _write_atomically(root / TRACKER_FILE, str(iteration))
    torch.distributed.barrier(group=group)
    return folder


# --- reading -----------------------------------------------------------------------------------


def verify(path: str | Path, *, group=None) -> tuple[Path, bool]:
    """Resolve ``path`` and check its files against the integrity manifest (collective).

    The group's first rank reads the files; every rank gets its verdict.

    Returns:
        ``(folder, verified)``: verified is False for checkpoints without a manifest (then only
        missing and truncated data files are found).

    Raises:
        FileNotFoundError, CheckpointDamagedError: on every rank, with the first rank's message.
    """

    def check() -> tuple[Path, bool]:
        folder = resolve_checkpoint_dir(path)
        return folder, verify_checkpoint_files(folder)

    return _on_first_rank(check, group)


def _files_of(folder: Path, key: str) -> list[str]:
    """The data files of ``folder`` that hold (part of) the tensor ``key``."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data or {}
    except Exception:  # noqa: BLE001 - only for the message; the data was read a moment ago
        return []
    return sorted({info.relative_path for index, info in storage.items() if index.fqn == key})


def _request_keys(request, path: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted path, checkpoint key)`` of every sharded tensor (or factory) of a request."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(request, (ShardedTensor, ShardedTensorFactory)):
        yield path, request.key
    elif isinstance(request, Mapping):
        for key, value in request.items():
            yield from _request_keys(value, f"{path}.{key}" if path else str(key))
    elif isinstance(request, (list, tuple)):
        for i, value in enumerate(request):
            yield from _request_keys(value, f"{path}.{i}" if path else str(i))


def read(folder: str | Path, request: dict, *, group=None) -> dict:
    """Load ``request`` (a sharded state dict) from a checkpoint folder; refuse non-finite values.

    Collective over ``group`` (default: the world). Files are not verified here (see
    :func:`verify`).

    Returns:
        The loaded state (``dist_checkpointing.load``'s result).

    Raises:
        CheckpointDamagedError: the data cannot be read (one line naming the cause).
        NonFiniteCheckpointError: a loaded tensor is NaN or infinite: named with its file.
    """
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    keys = dict(_request_keys(request))  # before loading: the load replaces the entries
    try:
        state = dist_checkpointing.load(request, str(folder), process_group=group)
    except BaseException as error:  # noqa: BLE001 - torch's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointDamagedError(
            f"cannot read the checkpoint {folder}: {describe_read_error(error)}"
        ) from None
    local = first_nonfinite((keys.get(p, p), t) for p, t in _state_tensors(state))
    found = nonfinite_on_any_rank(local, group)
    if found is not None:
        name, _ = found
        files = ", ".join(str(folder / f) for f in _files_of(folder, name)) or str(folder)
        raise NonFiniteCheckpointError(
            f"the checkpoint {folder} holds NaN or infinite values in {name} (in {files}); it "
            "is not loaded: resume from another iteration folder"
        )
    return state


def _unwrapped(chunks) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(chunks) if isinstance(chunks, (list, tuple)) else [chunks])


def read_model_state(path: str | Path, chunks, *, group=None) -> Path:
    """Load the model weights of a checkpoint into ``chunks`` strictly (no optimizer state).

    Collective over ``group`` (default: the world): resolves ``path`` (save root or iteration
    folder), verifies the files (:func:`verify`), loads the model part (``model`` or
    ``model0``, ``model1``, ... per virtual stage) through :func:`read` and copies it in.

    Args:
        path: save root or iteration folder.
        chunks: this rank's model chunks (a model, or a list; DDP/Float16Module wrappers are
            looked through).

    Returns:
        The checkpoint folder that was read.
    """
    folder, _ = verify(path, group=group)
    models = _unwrapped(chunks)
    state = read(folder, model_sharded_state(models), group=group)
    with torch.no_grad():
        for i, chunk in enumerate(models):
            chunk.load_state_dict(state["model" if len(models) == 1 else f"model{i}"], strict=True)
    return folder

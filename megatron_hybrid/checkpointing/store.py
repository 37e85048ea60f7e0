"""The checkpoint store: the folder format's names and listing, the one writer and the reader.

Every checkpoint folder of the package is written by :func:`write` and read through
:func:`read` (or :func:`read_model_state`); the format is described once, in
``docs/architecture.md`` ("The checkpoint folder"). The names and the folder listing
(:func:`resolve_load`, :func:`complete_iterations`, ...) are defined in ``folders.py`` and
exported here with the rest, so that the store is one import. What a checkpoint *holds* is the
business of its writer: ``training/checkpoint.py`` adds optimizer and RNG state, ``hf/dist.py``
the record of the Hugging Face model, ``training/resume.py`` decides what a run resumes from.

:func:`write` is atomic: the folder is written beside its place (``checkpointing/outputs.py``,
the package's one way to write a folder), complete with records, megatron-core's data and
``metadata.json`` and the integrity manifest, and moved into place only once every rank
succeeded; the tracker comes last. A failed, interrupted or killed save leaves the root as it
was. It refuses NaN and infinite values by name before anything is written.

Writers add what they need through three arguments, without touching this module:

* ``state`` takes any sharded state dict: model tensors, optimizer state, and tensors a writer
  carries that are not model parameters (a vision tower kept bitwise, ...). Carried tensors go
  under keys outside the model's roots (``embedding.``, ``decoder.``, ``output_layer.``,
  ``mtp.``), as ``ShardedTensor`` so that no rank holds them all; every floating tensor is
  checked like the model's. :func:`read` loads them back from a request with the same keys.
* ``records`` takes JSON records, one file each (``hf_model.json``, a LoRA config and base
  fingerprint, a source-format record, ...): readable without torch or the data files, and
  covered by the integrity manifest. :func:`read_record` reads one.
* ``files`` takes files to carry in a subfolder (the Hugging Face source's tokenizer files, in
  :data:`HF_FILES_DIR`), also covered by the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from megatron_hybrid.checkpointing.finite import (
    first_nonfinite,
    named_leaves,
    nonfinite_on_any_rank,
    state_tensors,
)
from megatron_hybrid.checkpointing.folders import (
    COMMON_RECORD,
    HF_FILES_DIR,
    HF_RECORD_FILE,
    INCOMPLETE_DIR,
    LOG_FILES,
    METADATA_FILE,
    MODEL_ONLY_FORMAT,
    PER_RANK_FORMAT,
    RELEASE,
    TRACKER_FILE,
    TRAIN_FORMAT,
    LoadTarget,
    complete_iterations,
    incomplete_iterations,
    is_complete,
    iteration_folder_name,
    iteration_folders,
    read_tracker,
    resolve_checkpoint_dir,
    resolve_load,
)
from megatron_hybrid.checkpointing.integrity import (
    INTEGRITY_FILE,
    CheckpointDamagedError,
    describe_read_error,
    verify_checkpoint_files,
    write_integrity_manifest,
)
from megatron_hybrid.checkpointing.outputs import (
    Output,
    OutputError,
    OutputExistsError,
    OutputWriteError,
)
from megatron_hybrid.checkpointing.sharded import model_sharded_state

__all__ = [
    "COMMON_RECORD",
    "HF_FILES_DIR",
    "LOG_FILES",
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
    "OutputError",
    "OutputWriteError",
    "common_record",
    "complete_iterations",
    "incomplete_iterations",
    "is_complete",
    "iteration_folder_name",
    "iteration_folders",
    "on_first_rank",
    "read",
    "read_common",
    "read_model_state",
    "read_record",
    "read_tracker",
    "resolve_checkpoint_dir",
    "resolve_load",
    "verify",
    "write",
]

# Files a record may not replace (megatron-core's and the manifest).
_RESERVED = frozenset({METADATA_FILE, INTEGRITY_FILE, "common.pt", ".metadata"})
_RECORD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.json")


class CheckpointExistsError(OutputExistsError):
    """The iteration folder already exists (or the root is not empty, for a checkpoint that
    replaces it) and overwriting was not asked for."""


class NonFiniteCheckpointError(ValueError):
    """A tensor to save or loaded is NaN or infinite; the message names it."""


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


def on_first_rank(work: Callable[[], Any], group=None) -> Any:
    """``work()`` on the group's first rank; every rank returns its result or raises its error."""
    payload: list = [None]
    if torch.distributed.get_rank(group) == 0:
        try:
            payload = [work()]
        except (OSError, ValueError) as error:  # CheckpointDamagedError is a ValueError
            payload = [error]
    first = torch.distributed.get_global_rank(group or torch.distributed.group.WORLD, 0)
    torch.distributed.broadcast_object_list(payload, src=first, group=group)
    if isinstance(payload[0], BaseException):
        raise payload[0]
    return payload[0]


# --- writing -----------------------------------------------------------------------------------


@contextmanager
def _prepared_folder_is_expected():
    """Hide megatron-core's "Overwriting old incomplete / corrupted checkpoint" warning while
    saving into a staging folder :func:`write` has just given its records
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


def _checked_files(files: Mapping[str, str | Path] | None) -> dict[str, Path]:
    """Carried files (``sub/folder/name`` -> source file), checked before anything is written."""
    checked = {}
    for name, source in (files or {}).items():
        parts = PurePosixPath(name).parts
        if (
            not parts
            or PurePosixPath(name).is_absolute()
            or ".." in parts
            or len(parts) < 2
            or parts[0] in _RESERVED
        ):
            raise ValueError(
                f"carried file {name!r}: give a relative path inside a subfolder of the "
                "checkpoint (such as hf_files/tokenizer.json)"
            )
        if not Path(source).is_file():
            raise FileNotFoundError(f"carried file {name!r}: {source} is not a file")
        checked[name] = Path(source)
    return checked


def _fill(folder: Path, records: Mapping[str, str], files: Mapping[str, Path]) -> None:
    """The first rank's part of a save before megatron-core's: the folder, records, files."""
    folder.mkdir(exist_ok=True)
    for name, text in records.items():
        _write_atomically(folder / name, text)
    for name, source in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, folder / name)


def write(
    root: str | Path,
    iteration: int | str,
    state: dict,
    records: Mapping[str, Mapping] | None = None,
    *,
    files: Mapping[str, str | Path] | None = None,
    overwrite: bool = False,
    replace_root: bool = False,
    sources=None,
    group=None,
) -> Path:
    """Save ``state`` as the checkpoint of ``iteration`` under the save root ``root``.

    Collective over ``group`` (default: the world; megatron-core 0.19.2's
    ``dist_checkpointing.save`` runs over the world, so the group must hold every rank). In
    order: every floating tensor of ``state`` is checked (nothing is written if one is NaN or
    infinite anywhere); the first rank checks the target and stages it beside itself
    (``checkpointing/outputs.py``): the iteration folder, or with ``replace_root`` the whole
    root; it writes the records and carried files there, megatron-core writes the data and
    ``metadata.json``, the first rank writes the integrity manifest over every file, and the
    ranks agree that all of it succeeded. Only then is the staged folder moved into place and
    the tracker replaced. A failure or interruption anywhere leaves the root as it was.

    Args:
        root: the save root.
        iteration: the iteration (``iter_0000010``), or ``"release"`` for a weights-only
            checkpoint (the root's only one: it implies ``replace_root``).
        state: the sharded state dict to save (``ShardedTensor``/factories/``ShardedObject``
            entries and common values), as ``dist_checkpointing.save`` takes it.
        records: file name (``*.json``) -> JSON object, written into the folder.
        files: ``subfolder/name`` -> a file to copy into the folder (the Hugging Face source's
            tokenizer files: ``hf_files/``); covered by the integrity manifest.
        overwrite: replace an existing iteration folder (with ``replace_root``: whatever the
            root holds) instead of refusing.
        replace_root: the checkpoint becomes the root's only content: the root is staged whole
            (iteration folder and tracker) and replaces what it held.
        sources: ``role -> path`` the command reads, which the output may not overlap.
        group: the process group of the ranks saving.

    Returns:
        The iteration folder.

    Raises:
        NonFiniteCheckpointError: a tensor of ``state`` is NaN or infinite (named; nothing is
            written).
        CheckpointExistsError: the folder exists (or, with ``replace_root``, the root is not
            empty) and ``overwrite`` is False.
        OutputError: the root is a source of the command, a file, or cannot be written.
        OutputWriteError: the write failed (a full disk, ...); the root is as it was.
        ValueError, TypeError: a record name or value that cannot be written.
    """
    from megatron.core import dist_checkpointing

    if iteration != RELEASE and (isinstance(iteration, bool) or not isinstance(iteration, int)
                                 or iteration < 0):  # fmt: skip
        raise ValueError(f"iteration {iteration!r}: give an int >= 0 or {RELEASE!r}")
    root = Path(root)
    replace_root = replace_root or iteration == RELEASE
    name = iteration_folder_name(iteration)
    folder = root / name
    encoded = _encoded_records(records)
    carried = _checked_files(files)
    found = nonfinite_on_any_rank(first_nonfinite(state_tensors(state)), group)
    if found is not None:
        key, rank = found
        raise NonFiniteCheckpointError(
            f"not saving {folder}: {key} has NaN or infinite values (rank {rank}); nothing "
            "was written"
        )
    target = root if replace_root else folder
    with Output(
        target,
        overwrite=overwrite,
        sources=sources,
        exists_error=CheckpointExistsError,
        group=group,
    ) as output:
        data = output.path / name if replace_root else output.path
        if output.first:
            output.run(_fill, data, encoded, carried)
        output.agree()
        _in_process_write_results()
        with _prepared_folder_is_expected():
            output.run(dist_checkpointing.save, state, str(data))
        output.agree()
        if output.first:
            output.run(write_integrity_manifest, data)
            if replace_root:
                output.run(_write_atomically, output.path / TRACKER_FILE, str(iteration))
            else:
                tracker = output.target.parent / TRACKER_FILE
                output.after_commit(lambda: _write_atomically(tracker, str(iteration)))
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

    return on_first_rank(check, group)


def _files_of(folder: Path, key: str) -> list[str]:
    """The data files of ``folder`` that hold (part of) the tensor ``key``."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data or {}
    except Exception:  # noqa: BLE001 - only for the message; the data was read a moment ago
        return []
    return sorted({info.relative_path for index, info in storage.items() if index.fqn == key})


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
    # Checkpoint keys by path, before loading (the load replaces the entries by tensors).
    keys = {path: leaf.key for path, leaf in named_leaves(request) if hasattr(leaf, "key")}
    try:
        state = dist_checkpointing.load(request, str(folder), process_group=group)
    except BaseException as error:  # noqa: BLE001 - torch's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointDamagedError(
            f"cannot read the checkpoint {folder}: {describe_read_error(error)}"
        ) from None
    local = first_nonfinite((keys.get(p, p), t) for p, t in named_leaves(state)
                            if isinstance(t, torch.Tensor))  # fmt: skip
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

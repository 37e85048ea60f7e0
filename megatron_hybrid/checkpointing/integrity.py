"""Are a checkpoint's files intact? The integrity manifest, written and verified.

After a save, :func:`write_integrity_manifest` records the SHA-256 digest and size of every file
of the folder in ``integrity.json``: megatron-core 0.19.2's manifest format
(``dist_checkpointing/validation.py``: ``{"algorithm": "sha256", "files": {name: digest}}``, so
``dist_checkpointing.load(..., verify_integrity=True)`` accepts it) plus the sizes, written
atomically so that a kill while writing it never leaves half a manifest.
:func:`verify_checkpoint_files` checks a folder against it and names the first damaged file.

The checkpoint store (``store.py``) writes the manifest after every save and names the file
(:data:`INTEGRITY_FILE`) among the folder's others.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = [
    "INTEGRITY_FILE",
    "CheckpointDamagedError",
    "describe_read_error",
    "verify_checkpoint_files",
    "write_integrity_manifest",
]

#: The manifest's file name in a checkpoint folder.
INTEGRITY_FILE = "integrity.json"
_ALGORITHM = "sha256"
_CHUNK = 1 << 20


class CheckpointDamagedError(ValueError):
    """A checkpoint file is missing, truncated or altered; the message names it."""


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            sha.update(chunk)
    return sha.hexdigest()


def write_integrity_manifest(folder: str | Path) -> Path:
    """Record the digest and size of every file under ``folder`` (one rank, after saving)."""
    folder = Path(folder)
    # Files in subfolders (carried files such as hf_files/tokenizer.json) by relative path, as
    # megatron-core's verification joins the names to the folder.
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / INTEGRITY_FILE)
    names = {p: p.relative_to(folder).as_posix() for p in files}
    manifest = {
        "algorithm": _ALGORITHM,
        "files": {names[p]: _digest(p) for p in files},
        "sizes": {names[p]: p.stat().st_size for p in files},
    }
    tmp = folder / f".{INTEGRITY_FILE}.tmp"
    with open(tmp, "w") as stream:
        json.dump(manifest, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, folder / INTEGRITY_FILE)
    return folder / INTEGRITY_FILE


def verify_checkpoint_files(folder: str | Path) -> bool:
    """Check every file of a checkpoint against its integrity manifest.

    Returns:
        True if the manifest exists and every file matches it; False if the checkpoint has no
        manifest (written by an older version or another tool): then only missing and truncated
        data files are found, from the offsets its ``.metadata`` records.

    Raises:
        CheckpointDamagedError: a listed file is missing, has another size or another digest,
            or the manifest itself is unreadable.
    """
    folder = Path(folder)
    path = folder / INTEGRITY_FILE
    if not path.is_file():
        _check_data_file_sizes(folder)
        return False
    try:
        manifest = json.loads(path.read_text())
        files, sizes = manifest["files"], manifest.get("sizes", {})
        if manifest.get("algorithm", _ALGORITHM) != _ALGORITHM or not isinstance(files, dict):
            raise ValueError("unsupported content")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointDamagedError(
            f"{path} is damaged ({error}); the checkpoint's files cannot be verified: resume "
            "from another iteration folder or delete this file to load without verification"
        ) from None
    fix = "restore it from a copy, or resume from another iteration folder"
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointDamagedError(f"checkpoint file {file} is missing; {fix}")
        size = file.stat().st_size
        if name in sizes and size != sizes[name]:
            raise CheckpointDamagedError(
                f"checkpoint file {file} is damaged: {size} bytes, {sizes[name]} when saved "
                f"(truncated or overwritten); {fix}"
            )
        if _digest(file) != digest:
            raise CheckpointDamagedError(
                f"checkpoint file {file} is damaged: its SHA-256 differs from the one recorded "
                f"in {INTEGRITY_FILE} when it was saved; {fix}"
            )
    return True


def _check_data_file_sizes(folder: Path) -> None:
    """Without a manifest: every data file must reach the end of the last item stored in it."""
    from torch.distributed.checkpoint import FileSystemReader

    fix = "restore it from a copy, or resume from another iteration folder"
    index = folder / ".metadata"
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except BaseException as error:  # noqa: BLE001 - torch raises BaseException subclasses too
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointDamagedError(
            f"checkpoint file {index} is damaged or missing ({describe_read_error(error)}); {fix}"
        ) from None
    ends: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        name = item.relative_path
        ends[name] = max(ends.get(name, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            raise CheckpointDamagedError(f"checkpoint file {file} is missing; {fix}")
        if file.stat().st_size < end:
            raise CheckpointDamagedError(
                f"checkpoint file {file} is truncated: {file.stat().st_size} bytes, but "
                f"{index.name} records data up to byte {end}; {fix}"
            )


def describe_read_error(error: BaseException) -> str:
    """One line for a failed checkpoint read (torch's CheckpointException nests the cause)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"

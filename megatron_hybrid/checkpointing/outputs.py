"""One way to write an output folder or file: checked first, staged beside it, moved in whole.

Every writer of the package goes through here: ``convert --to-hf/--to-peft/--save``, ``train
--save``, ``logprobs --output`` and the Python writers behind them (``save_hf_checkpoint``,
``save_peft_adapter``, the checkpoint store's ``write``). The rules, in the order they apply:

1. **Checked before any work** (:func:`check_output`): a target that is a source of the same
   command (the same path, inside one or holding one; symlinks and relative paths resolved) is
   refused always; a file where a folder goes (or the reverse), a file whose folder does not
   exist, or a place that cannot be written is refused; a non-empty target is refused unless
   ``overwrite`` (``--overwrite``: its old contents are *replaced*, never mixed with the new).
2. **Staged**: the output is written into a sibling on the same file system,
   ``.NAME.partial-TOKEN``, never into the target itself.
3. **Moved into place when complete**: a file with one atomic ``os.replace``; a folder with one
   ``os.rename`` where the target is missing or empty, and otherwise in three steps: the old
   folder is renamed aside (``.NAME.old-TOKEN``), the new one renamed in, the old one deleted.
   Between the first two renames (two metadata operations, microseconds) the target path does
   not exist; a kill exactly there leaves the old folder whole under ``.NAME.old-TOKEN``, and
   the next write of that target puts it back first (:func:`recover`).
4. **A failed or interrupted write** (an exception, Ctrl-C) removes its staging and leaves the
   target as it was; a write killed outright leaves a ``.NAME.partial-TOKEN`` sibling, which the
   next write of that target removes, so the re-run neither stops at it nor mixes it in.

Several processes (``torchrun``) write one output together through :class:`Output`: the first
rank of the group checks, stages and moves into place; every rank takes part in an agreement
(an all-gather of failures) after the work and after the move, so a failure on any rank is
raised on every rank and nothing is moved in. One writer per target at a time: two commands
writing the same target at once are not supported.

Importing this module loads no torch; :class:`Output` uses ``torch.distributed`` only where a
process group is initialised.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "OutputError",
    "OutputExistsError",
    "OutputInterrupted",
    "OutputWriteError",
    "Output",
    "check_output",
    "is_leftover",
    "recover",
    "recover_all",
]

#: Markers of a staging sibling (``.NAME.partial-TOKEN``) and of an old folder set aside while
#: its replacement moves in (``.NAME.old-TOKEN``).
PARTIAL = ".partial-"
ASIDE = ".old-"
#: What every refusal of a non-empty target advises (every writing command has the flag).
OVERWRITE_ADVICE = "pass --overwrite (overwrite=True in Python) to replace it"

Sources = Mapping[str, Any] | Iterable[tuple[str, Any]]


class OutputError(ValueError):
    """The path cannot be this command's output (a source of it, a file where a folder goes,
    a missing folder, a place that cannot be written); nothing was done."""


class OutputExistsError(FileExistsError):
    """The target is not empty and replacing it was not asked for; nothing was done."""


class OutputWriteError(OSError):
    """Writing the output failed (a full disk, permissions, ...); the target is as it was."""


class OutputInterrupted(KeyboardInterrupt):
    """Interrupted (Ctrl-C) while an output was written; the target is as it was."""


# --- checks --------------------------------------------------------------------------------


def _real(path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _source_items(sources: Sources | None) -> list[tuple[str, Path]]:
    items = sources.items() if isinstance(sources, Mapping) else (sources or ())
    return [(role, Path(path)) for role, path in items if path not in (None, "")]


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _name(flag: str | None, target) -> str:
    return f"{flag} {target}" if flag else str(target)


def _writable_ancestor(path: Path) -> Path:
    """The nearest existing folder at or above ``path`` (what creating ``path`` writes into)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(os.sep)


def is_empty(path: Path) -> bool:
    """Whether ``path`` is missing, an empty folder or an empty file."""
    if not path.exists():
        return True
    if path.is_dir():
        return next(path.iterdir(), None) is None
    return path.stat().st_size == 0


def check_output(
    target,
    *,
    kind: str = "folder",
    overwrite: bool = False,
    sources: Sources | None = None,
    flag: str | None = None,
    exists_error: type[Exception] = OutputExistsError,
) -> Path:
    """Refuse, before any work, an output the rules do not allow; return its resolved path.

    Args:
        target: the folder or file to write (relative paths and symlinks are resolved: the
            real location is written, so a link keeps pointing at the new output).
        kind: ``"folder"`` (missing parents are created) or ``"file"`` (its folder must exist).
        overwrite: a non-empty target may be replaced.
        sources: ``role -> path`` (or pairs) of what the command reads, e.g.
            ``{"--base-hf": base}``; the output may not be, lie inside or hold any of them.
        flag: how messages name the target (``"--to-hf"``).
        exists_error: the exception a non-empty target raises (a subclass of
            :class:`OutputExistsError` with its own message context).

    Raises:
        OutputError: a source, a file/folder of the other kind, a missing folder of a file, a
            place that cannot be written.
        OutputExistsError: not empty and ``overwrite`` is False.
    """
    if kind not in ("folder", "file"):
        raise ValueError(f"kind={kind!r}: 'folder' or 'file'")
    given = target
    target = _real(target)
    where = _name(flag, given)
    for role, source in _source_items(sources):
        real = _real(source)
        if _inside(target, real) or _inside(real, target):
            relation = (
                "is" if target == real else "lies inside" if _inside(target, real) else "holds"
            )
            raise OutputError(
                f"{where} {relation} {role} {source}, which this command reads: writing there "
                "would destroy its source (--overwrite does not change this); choose another "
                f"{kind}"
            )
    if kind == "folder" and target.exists() and not target.is_dir():
        raise OutputError(f"{where} is a file; give a folder (a new or an empty one)")
    if kind == "file":
        if target.is_dir():
            raise OutputError(f"{where} is a folder; give a file name")
        if not target.parent.is_dir():
            raise OutputError(
                f"{where}: the folder {target.parent} does not exist; create it first or choose "
                "another file"
            )
    ancestor = _writable_ancestor(target.parent)
    if not ancestor.is_dir():
        raise OutputError(f"{where}: {ancestor} is a file, so no folder can be made under it")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{where}: {ancestor} is not writable; choose a folder you can write")
    if not overwrite and not is_empty(target):
        what = "folder is not empty" if kind == "folder" else "file exists"
        raise exists_error(f"{where}: the {what}; {OVERWRITE_ADVICE}, or choose another {kind}")
    return target


# --- staging and leftovers -------------------------------------------------------------------


def _siblings(target: Path, marker: str) -> list[Path]:
    prefix = f".{target.name}{marker}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


def is_leftover(name: str) -> bool:
    """Whether a folder entry is a staging or set-aside sibling of some output."""
    return name.startswith(".") and (PARTIAL in name or ASIDE in name)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover(target) -> list[str]:
    """Undo what an interrupted write of ``target`` left: its staging siblings are removed; an
    old folder set aside is put back where the target is missing (a kill between the two
    renames), and removed otherwise (a kill after the new one moved in).

    Returns:
        One line per thing done (for a note).
    """
    target = Path(target)
    done = []
    asides = _siblings(target, ASIDE)
    if asides and not os.path.lexists(target):
        os.rename(asides[-1], target)
        done.append(f"{target}: put back from {asides[-1].name} (a write was interrupted)")
        asides = asides[:-1]
    for leftover in (*asides, *_siblings(target, PARTIAL)):
        _remove(leftover)
        done.append(f"removed {leftover} (left by an interrupted write)")
    return done


def recover_all(folder) -> list[str]:
    """:func:`recover` for every output of ``folder`` that left something (a save root)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = set()
    for entry in folder.iterdir():
        if is_leftover(entry.name):
            marker = PARTIAL if PARTIAL in entry.name else ASIDE
            names.add(entry.name[1:].rsplit(marker, 1)[0])
    return [line for name in sorted(names) for line in recover(folder / name)]


class _Stage:
    """One staged output of one process: :meth:`begin`, write into :attr:`path`, then
    :meth:`commit` or :meth:`discard`."""

    def __init__(self, target: Path, kind: str, overwrite: bool) -> None:
        self.target, self.kind, self.overwrite = target, kind, overwrite
        self.token = uuid.uuid4().hex[:12]
        self.path = target.with_name(f".{target.name}{PARTIAL}{self.token}")

    def begin(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.kind == "folder":
            self.path.mkdir()
        return self.path

    def discard(self) -> None:
        try:
            _remove(self.path)
        except OSError:
            pass  # the next write of the target removes it

    def commit(self) -> None:
        target = self.target
        if not self.overwrite and not is_empty(target):  # appeared since the check
            raise OutputExistsError(f"{target} was filled while it was written; not replaced")
        if self.kind == "file":
            os.replace(self.path, target)
            return
        if not os.path.lexists(target) or is_empty(target):
            os.rename(self.path, target)  # POSIX: replaces an empty folder atomically
            return
        aside = target.with_name(f".{target.name}{ASIDE}{self.token}")
        os.rename(target, aside)
        try:
            os.rename(self.path, target)
        except BaseException:
            try:
                os.rename(aside, target)
            except OSError:
                raise OutputWriteError(
                    f"{target} could not be replaced and its old contents could not be put back: "
                    f"they are whole in {aside}, and the next write of {target} restores them"
                ) from None
            raise
        try:
            shutil.rmtree(aside)
        except OSError as error:
            warnings.warn(
                f"{target} was replaced, but its old contents in {aside} could not be deleted "
                f"({error.strerror or error}); the next write of {target} removes them",
                stacklevel=3,
            )


# --- one output, written by one process or by the ranks of a group -----------------------------


def _reason(error: BaseException) -> str:
    """One line for a failed write: the file-system cause where there is one (torch's
    ``CheckpointException`` nests the ranks' errors)."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            where = f" ({current.filename})" if current.filename else ""
            return f"{current.strerror}{where}"
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                stack.append(value[0] if isinstance(value, tuple) else value)
        for inner in (current.__cause__, current.__context__):
            if inner is not None:
                stack.append(inner)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _distributed():
    """``torch.distributed`` where a process group is initialised (None otherwise; no torch
    import: a process that never loaded torch has no group)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available():
        return None
    return torch.distributed if torch.distributed.is_initialized() else None


class Output:
    """One output, checked, staged and moved into place; a context manager.

    In one process: ``with Output(target) as out:`` write into ``out.path``; on a normal exit
    the staged output moves into place, on an exception (Ctrl-C included) it is removed and the
    target is left as it was. Under ``torch.distributed`` every rank of ``group`` enters
    together: the first rank checks and stages, and every rank gets ``out.path`` (for writers
    whose ranks all write into the folder, such as megatron-core's ``dist_checkpointing.save``).
    Work that may fail on some ranks while the others go on (the rank that writes a gathered
    stream) goes through :meth:`run`, which records the first failure instead of raising it, so
    that the rank keeps taking part in the collectives; :meth:`agree` (and the exit) raise it on
    every rank.

    Args:
        target: the folder or file.
        kind, overwrite, sources, flag, exists_error: as :func:`check_output`.
        group: the process group of the ranks writing (default: the world).
    """

    def __init__(
        self,
        target,
        *,
        kind: str = "folder",
        overwrite: bool = False,
        sources: Sources | None = None,
        flag: str | None = None,
        exists_error: type[Exception] = OutputExistsError,
        group=None,
    ) -> None:
        self.given = target
        self.kind, self.overwrite, self.flag = kind, overwrite, flag
        self.sources, self.exists_error, self.group = sources, exists_error, group
        self.dist = _distributed()
        self.first = self.dist is None or self.dist.get_rank(group) == 0
        self.failure: BaseException | None = None
        self.path: Path | None = None
        self.target: Path | None = None
        self._stage: _Stage | None = None
        self._after: list[Callable[[], Any]] = []

    # -- collective agreement --

    def _gather(self, value) -> list:
        if self.dist is None:
            return [value]
        values: list = [None] * self.dist.get_world_size(self.group)
        self.dist.all_gather_object(values, value, group=self.group)
        return values

    def _raise_own(self) -> None:
        error = self.failure
        if isinstance(error, (OutputError, OutputExistsError, OutputWriteError)):
            raise error
        if isinstance(error, OSError):
            raise OutputWriteError(
                f"could not write {_name(self.flag, self.given)}: {_reason(error)}; it is left "
                "as it was"
            ) from error
        raise error

    def agree(self) -> None:
        """Collective: raise on every rank if any rank's work failed (that rank raises its own
        error; the others say which rank failed and why)."""
        mine = None if self.failure is None else _reason(self.failure)
        messages = self._gather(mine)
        if self.failure is not None:
            self._raise_own()
        failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
        if failed:
            rank, text = failed[0]
            raise OutputWriteError(
                f"{_name(self.flag, self.given)} was not written: rank {rank} failed ({text})"
            )

    def run(self, work: Callable[..., Any], *args, **kwargs) -> Any:
        """``work(*args, **kwargs)`` unless something failed already; a failure (an
        ``Exception``) is kept for :meth:`agree` instead of raised. Returns work's result
        (None after a failure)."""
        if self.failure is not None:
            return None
        try:
            return work(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - raised on every rank by agree()
            self.failure = error
            return None

    def after_commit(self, work: Callable[[], Any]) -> None:
        """Run ``work`` on the first rank once the output is in place (before the last
        agreement): e.g. a save root's tracker, which must name only complete checkpoints."""
        self._after.append(work)

    # -- the context --

    def __enter__(self) -> Output:
        if self.first:
            try:
                # What an interrupted write of this target left goes first (an old folder set
                # aside comes back), so the checks see the target as it is.
                recover(_real(self.given))
                self.target = check_output(
                    self.given,
                    kind=self.kind,
                    overwrite=self.overwrite,
                    sources=self.sources,
                    flag=self.flag,
                    exists_error=self.exists_error,
                )
                self._stage = _Stage(self.target, self.kind, self.overwrite)
            except (OutputError, OutputExistsError, OSError) as error:
                self.failure = error
            else:
                self.run(self._stage.begin)
        paths = self._gather(str(self._stage.path) if self._stage else None)
        try:
            self.agree()
        except BaseException:
            self._discard()
            raise
        self.path = Path(paths[0])
        self.target = self.target or _real(self.given)
        return self

    def _discard(self) -> None:
        if self.first and self._stage is not None:
            self._stage.discard()

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None:
            self._discard()
            if isinstance(error, KeyboardInterrupt) and not isinstance(error, OutputInterrupted):
                raise OutputInterrupted(
                    f"interrupted while writing {_name(self.flag, self.given)}; it is left as it "
                    "was"
                ) from None
            if isinstance(error, OSError) and not isinstance(
                error, (OutputWriteError, OutputExistsError)
            ):
                self.failure = error
                self._raise_own()
            return False
        try:
            self.agree()
            if self.first:
                self.run(self._stage.commit)
                for work in self._after:
                    self.run(work)
            self.agree()
        except BaseException as failure:
            self._discard()
            if isinstance(failure, KeyboardInterrupt):
                raise OutputInterrupted(
                    f"interrupted while writing {_name(self.flag, self.given)}; it is left as it "
                    "was"
                ) from None
            raise
        return False

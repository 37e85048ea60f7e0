"""The one way to write an output (``checkpointing/outputs.py``): checks before any work,
staging beside the target, the move into place, and what failures and kills leave behind.

Every case ends with the target either as it was or complete and new (never a mix) and no
sibling left behind; the writers' own fault-injection tests (``test_writer_faults.py``) run the
same cases through each writer of the package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_hybrid.checkpointing import outputs
from megatron_hybrid.checkpointing.outputs import (
    Output,
    OutputError,
    OutputExistsError,
    OutputInterrupted,
    OutputWriteError,
    check_output,
    recover,
)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``folder`` ({} if missing)."""
    if not folder.exists():
        return {}
    if folder.is_file():
        return {"": folder.read_bytes()}
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def siblings(target: Path) -> list[str]:
    """Entries beside ``target`` other than itself (staging or set-aside leftovers)."""
    return sorted(p.name for p in target.parent.iterdir() if p.name != target.name)


def old_folder(tmp_path: Path) -> Path:
    target = tmp_path / "out"
    (target / "sub").mkdir(parents=True)
    (target / "a.bin").write_bytes(b"old a")
    (target / "sub" / "b.txt").write_text("old b")
    return target


def write_new(path: Path) -> None:
    (path / "a.bin").write_bytes(b"new a")
    (path / "c.json").write_text("{}")


NEW = {"a.bin": b"new a", "c.json": b"{}"}


# --- checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        pytest.param(lambda t: t, {}, OutputError, r"--out \S+ is --in \S+, which this command "
                     "reads: writing there would destroy", id="source-itself"),
        pytest.param(lambda t: t / "x", {}, OutputError, r"lies inside --in", id="inside-source"),
        pytest.param(lambda t: t.parent, {"overwrite": True}, OutputError, r"holds --in",
                     id="holds-source-even-with-overwrite"),
        pytest.param(lambda t: t.parent / "link", {}, OutputError, r"is --in",
                     id="symlink-to-source"),
        pytest.param(lambda t: t.parent / "plain.txt", {}, OutputError,
                     r"plain\.txt is a file; give a folder", id="folder-onto-file"),
    ],
)  # fmt: skip
def test_check_output_refuses_sources_and_files(tmp_path, make, kwargs, error, match):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (tmp_path / "link").symlink_to(source)
    (tmp_path / "plain.txt").write_text("x")
    target = make(source)
    with pytest.raises(error, match=match):
        check_output(target, sources={"--in": source}, flag="--out", **kwargs)
    assert snapshot(source) == {"config.json": b"{}"}


def test_a_relative_path_is_the_same_source(tmp_path, monkeypatch):
    (tmp_path / "hf").mkdir()
    monkeypatch.chdir(tmp_path / "hf")
    with pytest.raises(OutputError, match="is --in"):
        check_output("../hf/.", sources={"--in": str(tmp_path / "hf")}, flag="--out")


@pytest.mark.parametrize(
    ("make", "kind", "match"),
    [
        pytest.param(lambda t: t / "missing" / "f.jsonl", "file",
                     r"the folder \S+missing does not exist", id="file-in-missing-folder"),
        pytest.param(lambda t: t, "file", r"is a folder; give a file name", id="file-onto-folder"),
        pytest.param(lambda t: t / "f.txt" / "out", "folder", r"f\.txt is a file, so no folder",
                     id="folder-under-a-file"),
    ],
)  # fmt: skip
def test_check_output_refuses_impossible_places(tmp_path, make, kind, match):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(OutputError, match=match):
        check_output(make(tmp_path), kind=kind)


def test_a_folder_that_cannot_be_written_is_refused_before_work(tmp_path, monkeypatch):
    """A read-only folder (simulated: the tests run as root, for whom ``chmod`` does not bite;
    ``os.access`` is what the check asks, and on a read-only file system it says no)."""
    readonly = tmp_path / "ro"
    readonly.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != readonly and real(p, m))
    with pytest.raises(OutputError, match=rf"{readonly} is not writable"):
        check_output(readonly / "out", flag="--to-hf")
    with pytest.raises(OutputError, match="is not writable"):
        with Output(readonly / "out"):
            pytest.fail("the body must not run")
    assert list(readonly.iterdir()) == []


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_non_empty_target_needs_overwrite(tmp_path, kind):
    target = tmp_path / "out"
    target.mkdir() if kind == "folder" else target.write_text("")
    check_output(target, kind=kind)  # empty: fine
    (target / "x").write_text("old") if kind == "folder" else target.write_text("old")
    with pytest.raises(OutputExistsError, match=r"pass --overwrite \(overwrite=True in Python\)"):
        check_output(target, kind=kind, flag="--save")
    assert check_output(target, kind=kind, overwrite=True) == target.resolve()


# --- writing ---------------------------------------------------------------------------------


def test_a_new_folder_is_staged_beside_and_moved_in(tmp_path):
    target = tmp_path / "deep" / "out"  # missing parents are created
    with Output(target) as out:
        assert out.path.parent == target.parent and out.path.name.startswith(".out.partial-")
        assert not target.exists()  # nothing at the target while writing
        write_new(out.path)
    assert snapshot(target) == NEW and siblings(target) == []


def test_overwrite_replaces_whole_never_mixes(tmp_path):
    target = old_folder(tmp_path)
    with pytest.raises(OutputExistsError):
        with Output(target):
            pytest.fail("the body must not run")
    with Output(target, overwrite=True) as out:
        write_new(out.path)
    assert snapshot(target) == NEW  # sub/b.txt of the old contents is gone
    assert siblings(target) == []


def test_a_file_is_replaced_atomically(tmp_path):
    target = tmp_path / "scores.jsonl"
    target.write_text("old\n")
    with Output(target, kind="file", overwrite=True) as out:
        out.path.write_text("new\n")
        assert target.read_text() == "old\n"
    assert target.read_text() == "new\n" and siblings(target) == []


@pytest.mark.parametrize(
    ("error", "raised", "match"),
    [
        pytest.param(OSError(28, "No space left on device", "x"), OutputWriteError,
                     r"could not write \S+out: No space left on device \(x\); it is left as it "
                     "was", id="full-disk"),
        pytest.param(KeyboardInterrupt(), OutputInterrupted,
                     r"interrupted while writing \S+out; it is left as it was", id="ctrl-c"),
        pytest.param(ValueError("bad tensor"), ValueError, "bad tensor", id="other-error"),
    ],
)  # fmt: skip
def test_a_failed_write_leaves_the_target_and_no_staging(tmp_path, error, raised, match):
    target = old_folder(tmp_path)
    before = snapshot(target)
    with pytest.raises(raised, match=match):
        with Output(target, overwrite=True) as out:
            (out.path / "a.bin").write_bytes(b"half")
            raise error
    assert snapshot(target) == before and siblings(target) == []
    with Output(target, overwrite=True) as out:  # the re-run works
        write_new(out.path)
    assert snapshot(target) == NEW


@pytest.mark.parametrize("fail_at", [1, 2], ids=["setting-old-aside", "moving-new-in"])
def test_a_failed_move_into_place_keeps_the_old_folder(tmp_path, monkeypatch, fail_at):
    target = old_folder(tmp_path)
    before = snapshot(target)
    real = os.rename
    calls = []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == fail_at:
            raise OSError(5, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OutputWriteError, match="Input/output error"):
        with Output(target, overwrite=True) as out:
            write_new(out.path)
    monkeypatch.setattr(os, "rename", real)
    assert snapshot(target) == before and siblings(target) == []


def test_a_kill_between_the_renames_is_undone_by_the_next_write(tmp_path):
    """The tiny window: the old folder renamed aside, the process killed before the new one
    moved in. The next write of the target (or ``recover``) puts the old folder back first."""
    target = old_folder(tmp_path)
    before = snapshot(target)
    os.rename(target, tmp_path / ".out.old-0123456789ab")
    (tmp_path / ".out.partial-0123456789ab").mkdir()  # the staged new folder, killed
    assert recover(target) and snapshot(target) == before and siblings(target) == []
    os.rename(target, tmp_path / ".out.old-0123456789ab")
    with pytest.raises(OutputExistsError):  # put back first, so the old folder is seen
        with Output(target):
            pass
    assert snapshot(target) == before and siblings(target) == []


def test_a_stale_staging_folder_neither_blocks_nor_pollutes_the_rerun(tmp_path):
    target = tmp_path / "out"
    stale = tmp_path / ".out.partial-deadbeef0000"
    stale.mkdir()
    (stale / "model-00001-of-00009.safetensors").write_bytes(b"killed")
    with Output(target) as out:
        write_new(out.path)
    assert snapshot(target) == NEW and siblings(target) == []


def test_negative_control_writing_in_place_mixes(tmp_path, monkeypatch):
    """Staging switched off (the staging path is the target itself, as the writers used to
    write): a failure leaves a mix of old and new files, which the tests above would catch."""
    target = old_folder(tmp_path)
    before = snapshot(target)

    def in_place(self, target, kind, overwrite):
        self.target, self.kind, self.overwrite, self.token = target, kind, overwrite, "x"
        self.path = target

    monkeypatch.setattr(outputs._Stage, "__init__", in_place)
    monkeypatch.setattr(outputs._Stage, "begin", lambda self: self.target)
    monkeypatch.setattr(outputs._Stage, "discard", lambda self: None)
    with pytest.raises(OutputWriteError):
        with Output(target, overwrite=True) as out:
            write_new(out.path)
            raise OSError(28, "No space left on device")
    assert snapshot(target) not in (before, NEW)


# --- several ranks ---------------------------------------------------------------------------


def _full_disk() -> None:
    raise OSError(28, "No space left on device")


def _ranks_worker(rank: int, world_size: int, target: str):
    """Every rank enters twice: rank 1 fails its part of the work the first time, nobody the
    second; returns what each rank raised each time."""
    raised = []
    for failing in (1, None):
        try:
            with Output(target, overwrite=True) as out:
                if rank == failing:
                    out.run(_full_disk)
                if out.first:
                    out.run(write_new, out.path)
                    if failing is not None:
                        assert snapshot(Path(target)) != NEW  # not moved in before the end
        except OutputWriteError as error:
            raised.append(str(error))
        else:
            raised.append(None)
        if failing is not None and out.first:
            raised.append(snapshot(Path(target)))
    return raised


@pytest.mark.distributed
def test_ranks_agree_on_a_failure_and_move_nothing(tmp_path):
    """Two gloo ranks; rank 1 fails while rank 0 writes: both raise (no hang) and the old folder
    stays; with no failure the new folder is in place."""
    from megatron_hybrid.testing.spawn import run_distributed

    target = old_folder(tmp_path)
    before = snapshot(target)
    first, second = run_distributed(_ranks_worker, 2, str(target), timeout=120)
    assert "rank 1 failed (No space left on device)" in first[0] and first[1] == before
    assert "could not write" in second[0] and "No space left on device" in second[0]
    assert first[2] is None and second[1] is None
    assert snapshot(target) == NEW and siblings(target) == []

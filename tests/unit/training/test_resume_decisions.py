"""Which folder a ``--load`` resolves to, what a resume sets aside, and the integrity manifest
(no training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hybrid.checkpointing.integrity import (
    CheckpointDamagedError,
    verify_checkpoint_files,
    write_integrity_manifest,
)
from megatron_hybrid.checkpointing.store import resolve_load
from megatron_hybrid.training.resume import check_target, set_aside_incomplete


def make_root(root: Path, complete=(), incomplete=(), tracker: str | None = None) -> Path:
    """A save root with fake iteration folders (complete ones have a ``metadata.json``)."""
    root.mkdir(exist_ok=True)
    for iteration in complete:
        folder = root / f"iter_{iteration:07d}"
        folder.mkdir()
        (folder / "metadata.json").write_text("{}")
    for iteration in incomplete:
        folder = root / f"iter_{iteration:07d}"
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"\0")
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return root


@pytest.mark.parametrize(
    ("complete", "incomplete", "tracker", "expected", "note"),
    [
        pytest.param((5,), (), "5", 5, None, id="tracker"),
        pytest.param((5, 10), (), "5", 10, "names iteration 5, but", id="newer_than_tracker"),
        pytest.param((5,), (10,), "5", 5, None, id="tracker_and_leftover"),
        pytest.param((5,), (10,), None, 5, None, id="no_tracker_newest_complete"),
        pytest.param((), (10,), None, None, "(only interrupted saves: iterations [10])",
                     id="only_leftovers_start_from_scratch"),
        pytest.param((), (), None, None, "ckpt holds no checkpoint yet", id="empty"),
        pytest.param((5,), (10,), "10", 5, "which is not a complete checkpoint: resuming from",
                     id="tracker_on_leftover"),
    ],
)  # fmt: skip
def test_resume_folder(tmp_path, complete, incomplete, tracker, expected, note):
    root = make_root(tmp_path / "ckpt", complete, incomplete, tracker)
    point = resolve_load(root)
    assert point.folder == (None if expected is None else root / f"iter_{expected:07d}")
    if note is None:
        assert point.notes == ()
    else:
        (line,) = point.notes
        assert note in line


def test_missing_load_directory_starts_from_scratch(tmp_path):
    assert resolve_load(tmp_path / "nothing").folder is None


@pytest.mark.parametrize(
    ("setup", "error", "match"),
    [
        pytest.param(lambda r: make_root(r, (), (10,), "10"), FileNotFoundError,
                     r"names .*iter_0000010, which is not a complete torch_dist checkpoint, and "
                     r"no iteration folder is complete", id="tracker_on_only_leftover"),
        pytest.param(lambda r: make_root(r, (5,), (), "abc"), CheckpointDamagedError,
                     r"holds 'abc', not an iteration number", id="tracker_abc"),
        pytest.param(lambda r: (make_root(r), (r / "model.bin").write_text("x")),
                     FileNotFoundError, r"is not a torch_dist checkpoint", id="not_a_checkpoint"),
    ],
)  # fmt: skip
def test_resume_folder_errors(tmp_path, setup, error, match):
    root = tmp_path / "ckpt"
    setup(root)
    with pytest.raises(error, match=match):
        resolve_load(root)


def test_set_aside_keeps_every_leftover(tmp_path):
    root = make_root(tmp_path / "ckpt", (5,), (10,))
    (moved,) = set_aside_incomplete(root)
    assert moved == (root / "iter_0000010", root / "incomplete" / "iter_0000010")
    make_root(root, (), (10,))  # the same crash again
    (again,) = set_aside_incomplete(root)
    assert again[1] == root / "incomplete" / "iter_0000010.1"
    assert sorted(p.name for p in root.iterdir()) == ["incomplete", "iter_0000005"]


def test_manifest_finds_a_changed_byte(tmp_path):
    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    data = folder / "__0_0.distcp"
    data.write_bytes(bytes(range(256)) * 4)
    write_integrity_manifest(folder)
    assert verify_checkpoint_files(folder) is True  # the control: intact files pass
    data.write_bytes(bytes(range(255, -1, -1)) * 4)  # same size, other bytes
    with pytest.raises(CheckpointDamagedError, match=r"__0_0.distcp is damaged: its SHA-256"):
        verify_checkpoint_files(folder)


def test_target_below_checkpoint_is_refused():
    check_target(10, 10, "ckpt/iter_0000010")  # nothing left to do is fine
    with pytest.raises(
        ValueError, match=r"--train-iters 9 is below iteration 10 .* --train-iters 10"
    ):
        check_target(10, 9, "ckpt/iter_0000010")

"""The checkpoint store: one writer (non-finite refusal, existence, stale files, records,
manifest, tracker last), the reader's refusal of non-finite values, and every writer of the
package going through it (each with a negative control: the check removed, the test fails)."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

from megatron_hybrid.checkpointing import store
from megatron_hybrid.checkpointing.integrity import verify_checkpoint_files


def _tensor_state(values: dict[str, torch.Tensor]) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state = {
        name: ShardedTensor.from_rank_offsets(name, tensor, replica_id=0)
        for name, tensor in values.items()
    }
    return {"carried": state, "iteration": 3}


def _finite(**extra) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4), **extra}


def test_write_lays_out_a_complete_verified_checkpoint(megatron_cpu, tmp_path):
    root = tmp_path / "ckpt"
    folder = store.write(root, 3, _tensor_state(_finite()), {"note.json": {"x": [1, 2]}})
    assert folder == root / "iter_0000003"
    assert store.is_complete(folder) and verify_checkpoint_files(folder) is True
    manifest = json.loads((folder / store.INTEGRITY_FILE).read_text())
    assert "note.json" in manifest["files"]  # records are covered by the manifest
    assert store.read_record(root, "note.json") == {"x": [1, 2]}
    assert store.read_record(root, "other.json") is None
    assert store.read_tracker(root / store.TRACKER_FILE) == 3
    assert store.resolve_checkpoint_dir(root) == folder
    request = _tensor_state({k: torch.zeros_like(v) for k, v in _finite().items()})
    loaded = store.read(folder, request)
    assert torch.equal(loaded["carried"]["a.weight"], _finite()["a.weight"])
    assert store.read_common(root)["iteration"] == 3


@pytest.mark.parametrize(
    ("bad", "dtype"),
    [
        pytest.param(float("nan"), torch.float32, id="nan"),
        pytest.param(float("inf"), torch.bfloat16, id="inf-bf16"),
        pytest.param(float("nan"), torch.float8_e4m3fn, id="nan-fp8"),
    ],
)
def test_write_refuses_a_nonfinite_tensor_by_name(megatron_cpu, tmp_path, bad, dtype):
    poisoned = torch.zeros(3, 5).to(dtype)
    poisoned[1, 2] = bad
    root = tmp_path / "ckpt"
    with pytest.raises(store.NonFiniteCheckpointError, match=r"c\.weight has NaN or infinite"):
        store.write(root, 1, _tensor_state(_finite(**{"c.weight": poisoned})))
    assert not root.exists()  # nothing written, not even the folder


def test_write_refuses_an_existing_folder_and_overwrites_when_asked(megatron_cpu, tmp_path):
    root = tmp_path / "ckpt"
    folder = store.write(root, 2, _tensor_state(_finite()), {"old.json": {"v": 1}})
    (folder / "stray.bin").write_bytes(b"x")
    with pytest.raises(store.CheckpointExistsError, match=r"iter_0000002: the folder is not empty"):
        store.write(root, 2, _tensor_state(_finite()))
    assert (folder / "stray.bin").exists()  # refused before anything was touched
    store.write(root, 2, _tensor_state(_finite()), {"new.json": {"v": 2}}, overwrite=True)
    names = {p.name for p in folder.iterdir()}
    assert "stray.bin" not in names and "old.json" not in names and "new.json" in names
    assert verify_checkpoint_files(folder) is True


def test_release_does_not_hide_another_checkpoint(megatron_cpu, tmp_path):
    root = tmp_path / "ckpt"
    store.write(root, 4, _tensor_state(_finite()))
    with pytest.raises(store.CheckpointExistsError, match=r"ckpt: the folder is not empty; pass -"):
        store.write(root, store.RELEASE, _tensor_state(_finite()))
    assert store.read_tracker(root / store.TRACKER_FILE) == 4


@pytest.mark.parametrize(
    ("records", "error", "match"),
    [
        pytest.param({"metadata.json": {}}, ValueError, "name .metadata.json.", id="reserved"),
        pytest.param({"../x.json": {}}, ValueError, "plain file name", id="path"),
        pytest.param({"x.txt": {}}, ValueError, "ending in .json", id="suffix"),
        pytest.param({"x.json": [1]}, TypeError, "must be a mapping", id="not-a-mapping"),
        pytest.param({"x.json": {"t": torch.ones(1)}}, TypeError, "not JSON serializable",
                     id="not-json"),
    ],
)  # fmt: skip
def test_bad_records_are_refused_before_writing(megatron_cpu, tmp_path, records, error, match):
    root = tmp_path / "ckpt"
    with pytest.raises(error, match=match):
        store.write(root, 1, _tensor_state(_finite()), records)
    assert not root.exists()


def test_a_save_that_fails_midway_leaves_the_old_checkpoint_whole(
    megatron_cpu, tmp_path, monkeypatch
):
    """The folder is staged beside its place: a failed overwrite (a full disk while megatron-core
    writes) leaves the old checkpoint complete and verified, no staging folder, and the tracker
    on it; the re-run writes."""
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    store.write(root, 1, _tensor_state(_finite()))
    folder = store.write(root, 2, _tensor_state(_finite()))
    before = (folder / store.INTEGRITY_FILE).read_text()
    save = dist_checkpointing.save

    def broken(state, path, **kwargs):
        (Path(path) / "__0_0.distcp").write_bytes(b"\0")
        raise OSError(28, "No space left on device", str(Path(path) / "__0_0.distcp"))

    monkeypatch.setattr(dist_checkpointing, "save", broken)
    with pytest.raises(store.OutputWriteError, match=r"iter_0000002: No space left on device"):
        store.write(root, 2, _tensor_state(_finite()), overwrite=True)
    assert verify_checkpoint_files(folder) is True
    assert (folder / store.INTEGRITY_FILE).read_text() == before
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000001", "iter_0000002", store.TRACKER_FILE
    ]  # fmt: skip
    assert store.read_tracker(root / store.TRACKER_FILE) == 2
    monkeypatch.setattr(dist_checkpointing, "save", save)
    store.write(root, 2, _tensor_state(_finite()), overwrite=True)
    assert verify_checkpoint_files(folder) is True


def _nonfinite_checkpoint(root: Path, monkeypatch) -> Path:
    """A checkpoint with a NaN in ``c.weight``, written with the store's check removed."""
    poisoned = torch.zeros(3, 5)
    poisoned[2, 0] = float("nan")
    with monkeypatch.context() as patch:
        patch.setattr(store, "first_nonfinite", lambda named: None)
        return store.write(root, 1, _tensor_state(_finite(**{"c.weight": poisoned})))


def test_read_refuses_nonfinite_values_naming_tensor_and_file(megatron_cpu, tmp_path, monkeypatch):
    folder = _nonfinite_checkpoint(tmp_path / "ckpt", monkeypatch)
    request = _tensor_state({k: torch.zeros(3, 5) if k == "c.weight" else torch.zeros_like(v)
                             for k, v in _finite(**{"c.weight": None}).items()})  # fmt: skip
    with pytest.raises(store.NonFiniteCheckpointError) as caught:
        store.read(folder, request)
    message = str(caught.value)
    assert "NaN or infinite values in c.weight" in message
    assert str(folder / "__0_0.distcp") in message


# --- every writer of the package goes through the store ------------------------------------


def _model(pattern: str = "[*-]"):
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid, small_config

    return build_hybrid(small_config(pattern), pattern, initialize_model_parallel())


def _poison(model) -> str:
    """Put an infinity into the dense MLP's output weight; return its checkpoint key."""
    from megatron_hybrid.checkpointing.inspect import sharded_tensor_shapes

    param = next(p for n, p in model.named_parameters() if "linear_fc2.weight" in n)
    with torch.no_grad():
        param.view(-1)[3] = float("inf")
    return next(k for k in sharded_tensor_shapes(model.sharded_state_dict()) if "fc2.weight" in k)


def _train_saver(model, root):
    from megatron_hybrid.training.checkpoint import save_checkpoint
    from megatron_hybrid.training.optimizers import CPUOptimizer

    optimizer = CPUOptimizer([model], lr=1e-3, weight_decay=0.0, clip_grad=0.0, pg_collection=None)
    return save_checkpoint(root, 1, [model], optimizer, pattern="[*-]")


def _convert_writer(model, root):
    from megatron_hybrid.hf.dist import save_model_state
    from megatron_hybrid.pattern import parse_pattern

    conversion = types.SimpleNamespace(hf_config={"model_type": "x"}, pattern=parse_pattern("[*-]"))
    return save_model_state(model, root, conversion)


WRITERS = {"train": _train_saver, "convert": _convert_writer, "store": None}


def _assert_refuses_nonfinite(writer, root: Path) -> None:
    model = _model()
    key = re.escape(_poison(model))
    if writer is None:
        state = {"model": model.sharded_state_dict(), "iteration": 1}
        write = lambda: store.write(root, 1, state)  # noqa: E731
    else:
        write = lambda: writer(model, root)  # noqa: E731
    with pytest.raises(store.NonFiniteCheckpointError, match=rf"{key} has NaN or infinite"):
        write()
    assert not root.exists()


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_refuses_a_nonfinite_weight(model_parallel, tmp_path, writer):
    _assert_refuses_nonfinite(WRITERS[writer], tmp_path / "ckpt")


@pytest.mark.parametrize("writer", list(WRITERS))
def test_negative_control_a_writer_without_the_check_fails_the_test(
    model_parallel, tmp_path, monkeypatch, writer
):
    monkeypatch.setattr(store, "first_nonfinite", lambda named: None)
    with pytest.raises(pytest.fail.Exception):
        _assert_refuses_nonfinite(WRITERS[writer], tmp_path / "ckpt")
    assert store.is_complete(store.resolve_checkpoint_dir(tmp_path / "ckpt"))  # it wrote


def test_read_model_state_round_trip_and_refusal(model_parallel, tmp_path, monkeypatch):
    model = _model()
    _convert_writer(model, tmp_path / "ckpt")
    other = _model()
    with torch.no_grad():
        for param in other.parameters():
            param.zero_()
    assert store.read_model_state(tmp_path / "ckpt", other) == tmp_path / "ckpt" / "release"
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    key = _poison(model)
    monkeypatch.setattr(store, "first_nonfinite", lambda named: None)
    _convert_writer(model, tmp_path / "bad")
    monkeypatch.undo()
    with pytest.raises(store.NonFiniteCheckpointError, match=rf"values in {re.escape(key)} \(in "):
        store.read_model_state(tmp_path / "bad", other)

"""What ``train --save DIR`` may write into (``training/save_target.py``), decided before the
first step: this run's own checkpoints yes; another run's, another model's, a converted
checkpoint or other files only with ``--overwrite``, which then replaces all of it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron_hybrid.checkpointing import store
from megatron_hybrid.training.save_target import (
    RUN_KEY,
    SaveTargetError,
    decide_save_target,
)

PATTERN = "[*-]"
SETTINGS = {"hybrid_layer_pattern": PATTERN, "hidden_size": 64, "num_attention_heads": 4}


def checkpoint(root: Path, iteration, *, run: str | None = "run-a", **model) -> Path:
    """A small checkpoint through the store, recording a run and model settings as train does."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    record = {"format": store.TRAIN_FORMAT, "hybrid_layer_pattern": PATTERN,
              "model": {**SETTINGS, **model}}  # fmt: skip
    if run is not None:
        record[RUN_KEY] = run
    if iteration == store.RELEASE:
        record = {"format": store.MODEL_ONLY_FORMAT, "hybrid_layer_pattern": PATTERN}
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0),
        "iteration": 0 if iteration == store.RELEASE else iteration,
        store.COMMON_RECORD: record,
    }
    return store.write(root, iteration, state, overwrite=True)


def decide(root: Path, *, resumed=None, start=0, overwrite=False, lora=False, **settings):
    args = argparse.Namespace(save=str(root), overwrite=overwrite, train_iters=8, save_interval=4)
    return decide_save_target(args, start, resumed, {**SETTINGS, **settings}, lora=lora)


def test_a_resume_into_its_own_root_saves_as_before(megatron_cpu, tmp_path):
    root = tmp_path / "run"
    folder = checkpoint(root, 4)
    target = decide(root, resumed=folder, start=4)
    assert (target.run, target.replace_root) == ("run-a", False)  # the run goes on
    checkpoint(root, 8)  # a later save of this run, which it would write again
    with pytest.raises(SaveTargetError, match=r"already holds iteration\(s\) \[8\] that this run"):
        decide(root, resumed=folder, start=4)
    assert decide(root, resumed=folder, start=4, overwrite=True).replace_root is False


def test_an_empty_root_or_one_with_leftovers_is_a_new_run(megatron_cpu, tmp_path):
    root = tmp_path / "run"
    assert decide(root).replace_root is False and len(decide(root).run) == 32
    (root / ".iter_0000004.partial-0123").mkdir(parents=True)  # a killed save
    (root / "incomplete").mkdir()
    assert decide(root).replace_root is False
    assert decide(root).run != decide(root).run  # minted per run


@pytest.mark.parametrize(
    ("make", "settings", "match"),
    [
        pytest.param(lambda r: checkpoint(r, 4, hidden_size=32), {},
                     r"the checkpoints of another model \(--hidden-size 32 \(this run: 64\)\)",
                     id="another-model"),
        pytest.param(lambda r: checkpoint(r, 4), {"lora": True},
                     r"the checkpoints of another model \(a full model \(this run: LoRA\)\)",
                     id="full-vs-lora"),
        pytest.param(lambda r: checkpoint(r, 4, run="run-b"), {},
                     r"the checkpoints of another run of the same model \(\S+iter_0000004; this "
                     r"run starts from scratch, it does not continue that one\)",
                     id="another-run-same-model"),
        pytest.param(lambda r: checkpoint(r, store.RELEASE), {},
                     r"a converted checkpoint \(convert --from-hf: weights only\)",
                     id="converted"),
        pytest.param(lambda r: (r.mkdir(), (r / "config.json").write_text("{}")), {},
                     r"files that are no checkpoint of this run \(config\.json\)",
                     id="other-files"),
        pytest.param(lambda r: checkpoint(r, 4, run=None, hidden_size=32), {},
                     r"the checkpoints of another model \(--hidden-size 32",
                     id="older-checkpoint-other-model"),
    ],
)  # fmt: skip
def test_another_runs_folder_is_refused_unless_overwrite(
    megatron_cpu, tmp_path, make, settings, match
):
    root = tmp_path / "run"
    make(root)
    before = sorted(p.name for p in root.rglob("*"))
    with pytest.raises(SaveTargetError, match=rf"--save {root} holds {match}") as refused:
        decide(root, **settings)
    assert "saving there would mix two runs" in str(refused.value)
    assert "save into another folder, or pass --overwrite to replace what it holds" in str(
        refused.value
    )
    assert sorted(p.name for p in root.rglob("*")) == before  # nothing touched
    assert decide(root, overwrite=True, **settings).replace_root is True


def test_an_older_checkpoint_of_the_same_model_is_accepted(megatron_cpu, tmp_path):
    """Checkpoints written before runs had an identity: the same model settings count as this
    run's, as every version before accepted them."""
    root = tmp_path / "run"
    checkpoint(root, 2, run=None)  # an iteration this run does not write again
    assert decide(root).replace_root is False


def test_a_resume_from_elsewhere_carries_the_run(megatron_cpu, tmp_path):
    """``--load A --save B`` where B holds the same run's later checkpoints: the same run."""
    first = checkpoint(tmp_path / "a", 4)
    checkpoint(tmp_path / "b", 8)
    target = decide(tmp_path / "b", resumed=first, start=4, overwrite=True)
    assert (target.run, target.replace_root) == ("run-a", False)


def test_the_first_save_of_an_overwrite_replaces_the_root_whole(model_parallel, tmp_path):
    """``--overwrite`` over another run's folder: the first save stages the whole root and
    moves it in, so not one of the old run's folders or files survives beside the new one."""
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid, small_config
    from megatron_hybrid.training.checkpoint import save_checkpoint
    from megatron_hybrid.training.optimizers import CPUOptimizer

    root = tmp_path / "run"
    checkpoint(root, 4, run="run-b", hidden_size=32)
    checkpoint(root, 8, run="run-b", hidden_size=32)
    (root / "notes.txt").write_text("old")
    model = build_hybrid(small_config(PATTERN), PATTERN, initialize_model_parallel())
    optimizer = CPUOptimizer([model], lr=1e-3, weight_decay=0.0, clip_grad=0.0, pg_collection=None)
    save_checkpoint(root, 2, [model], optimizer, pattern=PATTERN, overwrite=True, run="run-c",
                    replace_root=True)  # fmt: skip
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", store.TRACKER_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing left beside it
    assert store.common_record(store.read_common(root))[RUN_KEY] == "run-c"

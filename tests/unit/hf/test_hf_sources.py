"""Sources are checked once, by name: a non-finite tensor in a Hugging Face folder or a
``torch_dist`` checkpoint, a truncated shard, a config.json without a required field. The Python
API raises the package's errors; the CLI prints one message, exits 2 and writes nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import hf_oracle
import pytest
import torch

from megatron_hybrid.hf import HFCheckpointError, HFConfigError, load_hf_model
from megatron_hybrid.hf import stream as hf_stream
from megatron_hybrid.hf import weights as hf_weights


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny sharded Qwen3.5-MoE folder (index + several safetensors files)."""
    return hf_oracle.make_hf_checkpoint(
        "qwen3_5_moe", tmp_path_factory.mktemp("hf") / "qwen3_5_moe", max_shard_size="40KB"
    )


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def _expert_tensor(folder: Path) -> tuple[str, str]:
    """``(tensor, file)`` of a routed-expert weight."""
    for file, names in hf_oracle.safetensors_files(folder).items():
        for name in names:
            if ".experts." in name and name.endswith("weight") or name.endswith("gate_up_proj"):
                return name, file
    raise AssertionError("no expert weight in the fixture")


def _poison(folder: Path, value: float = float("inf")) -> tuple[str, Path]:
    """Put ``value`` into one element of an expert weight; return its name and file."""
    from safetensors.torch import load_file, save_file

    name, file = _expert_tensor(folder)
    tensors = load_file(folder / file)
    tensors[name].view(-1)[5] = value
    save_file(tensors, folder / file, metadata={"format": "pt"})
    return name, folder / file


def _convert(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and the stderr a terminal shows (the erased progress bar left out)."""
    from megatron_hybrid.cli.main import main

    code = main(["convert", *argv])
    captured = capsys.readouterr()
    shown = [line.rsplit("\r", 1)[-1] for line in captured.err.split("\n")]
    return code, captured.out, "\n".join(line for line in shown if line.strip())


def test_api_refuses_an_infinite_expert_weight_by_name(source, tmp_path, pg):
    folder = _copy(source, tmp_path)
    name, file = _poison(folder)
    with pytest.raises(HFCheckpointError, match=rf"{file}: tensor {name} has NaN or infinite"):
        load_hf_model(folder)


def _assert_cli_refuses(folder: Path, save: Path, capsys, name: str, file: Path) -> None:
    code, _, err = _convert(capsys, "--from-hf", str(folder), "--save", str(save))
    assert code == 2, err
    (line,) = err.splitlines()  # one message, no traceback
    assert line.startswith("python -m megatron_hybrid convert: error: ")
    assert f"{file}: tensor {name} has NaN or infinite values" in line
    assert not save.exists()  # nothing written


def test_cli_refuses_an_infinite_source_and_writes_nothing(source, tmp_path, pg, capsys):
    folder = _copy(source, tmp_path)
    name, file = _poison(folder)
    _assert_cli_refuses(folder, tmp_path / "ckpt", capsys, name, file)


def test_negative_control_without_the_check_the_inf_converts(
    source, tmp_path, pg, capsys, monkeypatch
):
    """The read path's check removed: the inf reaches the model and the test above fails
    (the store's own refusal is what is left, a later and vaguer message)."""
    folder = _copy(source, tmp_path)
    name, file = _poison(folder)
    monkeypatch.setattr(hf_weights, "require_finite", lambda src, n, values: values)
    with pytest.raises(AssertionError):
        _assert_cli_refuses(folder, tmp_path / "ckpt", capsys, name, file)


def test_a_truncated_shard_is_one_message(source, tmp_path, pg, capsys):
    folder = _copy(source, tmp_path)
    _, file = _expert_tensor(folder)
    os.truncate(folder / file, (folder / file).stat().st_size - 10)
    with pytest.raises(HFCheckpointError, match=rf"{folder / file} is damaged \(.*incomplete"):
        load_hf_model(folder)
    for argv in (["--save", str(tmp_path / "ckpt")], ["--dry-run"]):
        code, _, err = _convert(capsys, "--from-hf", str(folder), *argv)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"{folder / file} is damaged" in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()


def test_an_index_that_disagrees_with_its_files_is_named(source, tmp_path, pg):
    folder = _copy(source, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name, file = _expert_tensor(folder)
    other = next(f for f in index["weight_map"].values() if f != file)
    index["weight_map"][name] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=rf"in {folder / other} that it does not hold"):
        load_hf_model(folder)


@pytest.mark.parametrize("same", [False, True], ids=["different-values", "equal-values"])
def test_a_tensor_stored_in_two_shards_is_refused_naming_both(source, tmp_path, pg, same):
    """A copy of a tensor in a second shard: the index names one file, the loader would read
    that one, another reader the other. Refused by name with both files, equal values or not."""
    from safetensors.torch import load_file, save_file

    folder = _copy(source, tmp_path)
    name, file = _expert_tensor(folder)
    other = next(f for f in hf_oracle.safetensors_files(folder) if f != file)
    value = load_file(folder / file)[name]
    tensors = load_file(folder / other)
    tensors[name] = value.clone() if same else value + 1
    save_file(tensors, folder / other, metadata={"format": "pt"})
    first, second = sorted([file, other])
    match = rf"tensor {name} is stored twice, in {folder / first} and in {folder / second}"
    with pytest.raises(HFCheckpointError, match=match):
        load_hf_model(folder)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(lambda c: c.pop("hidden_size"), r"config\.json has no 'hidden_size'",
                     id="missing-hidden-size"),
        pytest.param(lambda c: c.update(num_experts="eight"), r"wrong kind or value \(ValueError",
                     id="non-numeric"),
    ],
)  # fmt: skip
def test_a_damaged_config_is_one_message(source, tmp_path, pg, capsys, edit, match):
    folder = _copy(source, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError, match=match):
        load_hf_model(folder)
    code, _, err = _convert(capsys, "--from-hf", str(folder), "--save", str(tmp_path / "ckpt"))
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "qwen3_5_moe config cannot be converted" in err or "wrong kind" in err


def test_a_nonfinite_torch_dist_checkpoint_is_refused_by_name(
    source, tmp_path, pg, capsys, monkeypatch
):
    """``convert --load CKPT --to-hf``: the checkpoint's NaN is named with its file, and no
    Hugging Face folder is written. (The checkpoint is made with the store's check removed.)"""
    from megatron_hybrid.checkpointing import store

    folder = _copy(source, tmp_path)
    name, _ = _poison(folder)
    monkeypatch.setattr(hf_weights, "require_finite", lambda src, n, values: values)
    monkeypatch.setattr(store, "first_nonfinite", lambda named: None)
    code, _, err = _convert(capsys, "--from-hf", str(folder), "--save", str(tmp_path / "ckpt"))
    assert code == 0, err
    monkeypatch.undo()
    code, _, err = _convert(capsys, "--load", str(tmp_path / "ckpt"), "--to-hf",
                            str(tmp_path / "out"))  # fmt: skip
    assert code == 2, err
    (line,) = err.splitlines()
    release = tmp_path / "ckpt" / "release"
    assert f"the checkpoint {release} holds NaN or infinite values in " in line
    assert f"(in {release}/__0_0.distcp)" in line and "experts" in line
    assert not (tmp_path / "out").exists()
    assert torch.isinf(hf_oracle.read_tensors(folder)[name]).any()


class _Counts:
    """How often the folder is opened, its config converted and its weights planned."""

    def __init__(self, monkeypatch):
        from megatron_hybrid.hf import api as hf_api
        from megatron_hybrid.hf import config as hf_config
        from megatron_hybrid.hf import io as hf_io

        self.opened = self.converted = self.planned = 0
        init, convert = hf_io.HFCheckpoint.__init__, hf_config.convert_config
        plan = hf_weights.build_plan

        def counting_init(this, *args, **kwargs):
            self.opened += 1
            init(this, *args, **kwargs)

        def counting_convert(*args, **kwargs):
            self.converted += 1
            return convert(*args, **kwargs)

        def counting_plan(*args, **kwargs):
            self.planned += 1
            return plan(*args, **kwargs)

        monkeypatch.setattr(hf_io.HFCheckpoint, "__init__", counting_init)
        monkeypatch.setattr(hf_config, "convert_config", counting_convert)
        monkeypatch.setattr(hf_weights, "build_plan", counting_plan)
        monkeypatch.setattr(hf_api, "build_plan", counting_plan)
        monkeypatch.setattr(hf_stream, "build_plan", counting_plan)

    def __call__(self) -> tuple[int, int, int]:
        return self.opened, self.converted, self.planned


def test_convert_opens_converts_and_plans_once(source, tmp_path, pg, capsys, monkeypatch):
    counts = _Counts(monkeypatch)
    code, _, err = _convert(capsys, "--from-hf", str(source), "--save", str(tmp_path / "ckpt"))
    assert code == 0, err
    assert counts() == (1, 1, 1)


def test_negative_control_the_counts_see_a_second_pass(source, pg, monkeypatch):
    """A dry run followed by a plain load (how convert used to work) is counted twice."""
    from megatron_hybrid.hf import dry_run

    counts = _Counts(monkeypatch)
    dry_run(source)
    load_hf_model(source)
    assert counts() == (2, 2, 2)


def test_load_hf_settings_are_read_once_and_the_flags_left_alone(source, monkeypatch):
    """--load-hf: the conversion's settings are validated (a message names its real expert
    count) and the config is built once from the conversion and the training flags, without
    writing the architecture into the parsed flags or building a config of them first."""
    import copy

    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.runtime import select_backend
    from megatron_hybrid.training import config as training_config
    from megatron_hybrid.training import run
    from megatron_hybrid.training.hf_source import hf_source
    from megatron_hybrid.training.train_settings import settings_from_args
    from megatron_hybrid.training.validation import SettingsError, validate_settings

    parser = build_parser(load_commands())
    args = settings_from_args(parser.parse_args(["train", "--load-hf", str(source),
                              "--expert-model-parallel-size", "3", "--moe-aux-loss-coeff",
                              "0.01"]))  # fmt: skip
    before = copy.deepcopy(args)
    hf = hf_source(args)
    assert args == before  # nothing written back into the flags
    experts = hf.conversion.config_kwargs["num_moe_experts"]
    effective = hf.applied_to(args)
    assert effective.num_experts == experts and args.num_experts is None
    assert effective.hybrid_layer_pattern == hf.conversion.pattern.pattern
    assert args.hybrid_layer_pattern is None
    with pytest.raises(SettingsError, match=rf"--num-experts {experts} is not divisible by "
                       r"--expert-model-parallel-size 3"):  # fmt: skip
        validate_settings(effective, world_size=3)

    def refuse(*args, **kwargs):
        raise AssertionError("a config of the flags was built")

    monkeypatch.setattr(training_config, "hybrid_config_from_args", refuse)
    monkeypatch.setattr(run, "hybrid_config_from_args", refuse)  # the name run.py calls
    config = run.model_config(effective, hf, select_backend("cpu"))
    assert config.num_moe_experts == experts and config.moe_aux_loss_coeff == 0.01
    assert config.expert_model_parallel_size == 3
    assert config.hidden_size == hf.conversion.config_kwargs["hidden_size"]

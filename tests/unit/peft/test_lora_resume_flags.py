"""``train --load RUN`` with LoRA flags: flags that change the adapters must agree with the
run's record (else they would be ignored silently); ``--lora-dropout`` applies. With
``--load-peft`` the folder gives the adapters' config, and ``--lora-dropout`` applies too."""

from __future__ import annotations

import json

import pytest

from megatron_hybrid.peft import LoRAConfig, LoRAConfigError
from megatron_hybrid.peft.checkpoint import LORA_RECORD, base_fingerprint


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """A stand-in adapter checkpoint (rank 4, alpha 8, two targets) trained on a stand-in
    Hugging Face base; returns the ``train`` arguments that resume it."""
    from megatron_hybrid.checkpointing.folders import METADATA_FILE
    from megatron_hybrid.training import lora

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "stand-in"}))
    run = tmp_path / "run"
    run.mkdir()
    (run / METADATA_FILE).write_text("{}")
    config = LoRAConfig(rank=4, alpha=8, targets=["linear_qkv", "linear_fc1"])
    fingerprint = base_fingerprint(hf_path=hf)
    record = {"lora": config.to_dict(), "base": {"hf": str(hf), "fingerprint": fingerprint}}
    (run / LORA_RECORD).write_text(json.dumps(record))
    monkeypatch.setattr(lora, "conversion_for", lambda path: None)

    def resume(*flags: str):
        from megatron_hybrid.cli.main import build_parser, load_commands
        from megatron_hybrid.training.train_settings import settings_from_args

        argv = ["train", "--load-hf", str(hf), "--load", str(run), *flags]
        return lora.lora_run(settings_from_args(build_parser(load_commands()).parse_args(argv)))

    return resume


@pytest.mark.parametrize(
    "flags",
    [[], ["--lora-rank", "4", "--lora-alpha", "8"], ["--lora-targets", "linear_fc1", "linear_qkv"]],
    ids=["none", "same_rank_alpha", "same_targets_reordered"],
)
def test_agreeing_flags_resume_the_record(run_folder, flags):
    config = run_folder(*flags).config
    assert (config.rank, config.alpha, set(config.targets)) == (
        4,
        8.0,
        {"linear_qkv", "linear_fc1"},
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "8"], r"--lora-rank 4"),
        (["--lora-alpha", "16"], r"--lora-alpha 8\.0"),
        (["--lora-targets", "all-linear"], r"--lora-targets \('linear_qkv', 'linear_fc1'\)"),
        (["--lora-exclude", "linear_fc1"], r"--lora-exclude \(\)"),
    ],
    ids=["rank", "alpha", "targets", "exclude"],
)
def test_contradicting_flags_are_refused(run_folder, flags, message):
    with pytest.raises(LoRAConfigError, match=message + r".*would be ignored"):
        run_folder(*flags)


def test_dropout_applies_on_resume(run_folder):
    assert run_folder("--lora-dropout", "0.1").config.dropout == 0.1


@pytest.mark.parametrize(
    "flags",
    [["--lora-alpha", "8"], ["--lora-targets", "q_proj"], ["--lora-exclude", "q_proj"]],
    ids=["alpha", "targets", "exclude"],
)
def test_load_peft_refuses_flags_it_would_ignore(flags):
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.lora_rules import validate_lora_flags
    from megatron_hybrid.training.settings import SettingsError

    argv = ["train", "--load-hf", "h", "--load-peft", "p", *flags]
    with pytest.raises(SettingsError, match=f"drop {flags[0]}"):
        validate_lora_flags(build_parser(load_commands()).parse_args(argv))


def test_load_peft_takes_the_dropout_flag(cases, pg):
    """``--load-peft A --lora-dropout P`` trains with dropout P (the folder says 0)."""
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.peft.apply import adapters
    from megatron_hybrid.training.lora import lora_run
    from megatron_hybrid.training.train_settings import settings_from_args

    case = cases["qwen3_5_moe"]
    argv = ["train", "--load-hf", str(case.hf), "--load-peft", str(case.adapter)]
    for flags, expected in (([], {0.0}), (["--lora-dropout", "0.25"], {0.25})):
        run = lora_run(
            settings_from_args(build_parser(load_commands()).parse_args([*argv, *flags]))
        )
        model = load_hf_model(case.hf)
        run.attach([model])
        assert {adapter.dropout for adapter in adapters(model)} == expected

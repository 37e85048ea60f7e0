"""HF -> torch_dist -> HF through the command line: every tensor, its dtype and bits, MTP too.

MTP layers have no forward in transformers (it drops ``mtp.*`` and DeepSeek's extra layer), so
they are proven by names and this round trip; the rest also by transformers' logits of the
written folder, which must equal the source's bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hf_oracle
import pytest
import torch

pytestmark = pytest.mark.slow


def _convert(*args: str) -> subprocess.CompletedProcess:
    # A fresh process: no torch.distributed rendezvous left in the environment by other tests.
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "convert", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("qwen3_5_moe", torch.float32),
        ("deepseek_v3", torch.bfloat16),
        ("nemotron_h", torch.bfloat16),
    ],
    ids=["qwen3_5_moe-fp32-mtp-sharded", "deepseek_v3-bf16-mtp", "nemotron_h-bf16-mtp"],
)
def test_cli_round_trip_is_bitwise(family, dtype, tmp_path, input_ids):
    source = hf_oracle.make_hf_checkpoint(
        family, tmp_path / "hf", dtype=dtype, max_shard_size="60KB", mtp_layers=1
    )
    mtp = hf_oracle.add_fake_mtp_tensors(source, family)
    assert mtp  # the MTP tensors are part of what must survive

    dry = _convert("--from-hf", str(source), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "OK" in dry.stdout and "/" in dry.stdout.splitlines()[0]  # an MTP part in the pattern
    forward = _convert("--from-hf", str(source), "--save", str(tmp_path / "ckpt"))
    assert forward.returncode == 0, forward.stderr
    back = _convert(
        "--load",
        str(tmp_path / "ckpt"),
        "--to-hf",
        str(tmp_path / "out"),
        "--max-shard-size",
        "60KB",
    )
    assert back.returncode == 0, back.stderr

    before = hf_oracle.read_tensors(source)
    after = hf_oracle.read_tensors(tmp_path / "out")
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name], tensor), name
    router_bias = {
        "deepseek_v3": "model.layers.1.mlp.gate.e_score_correction_bias",
        "nemotron_h": "backbone.layers.1.mixer.gate.e_score_correction_bias",
    }
    if family in router_bias:
        assert after[router_bias[family]].dtype == torch.float32
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == json.loads((source / "config.json").read_text())["model_type"]
    # transformers loads the written folder and computes bitwise the source's logits.
    assert torch.equal(
        hf_oracle.hf_logits(tmp_path / "out", input_ids), hf_oracle.hf_logits(source, input_ids)
    )


def test_cli_refuses_a_conversion_with_problems(tmp_path):
    source = hf_oracle.make_hf_checkpoint("qwen3_5", tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    config["sliding_window_pattern"] = 4
    (source / "config.json").write_text(json.dumps(config))
    dry = _convert("--from-hf", str(source), "--dry-run")
    assert dry.returncode == 1
    assert "sliding_window_pattern" in dry.stdout
    run = _convert("--from-hf", str(source), "--save", str(tmp_path / "ckpt"))
    assert run.returncode == 2
    assert "sliding_window_pattern" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--from-hf", "x"],
        ["--load", "x"],
        ["--from-hf", "x", "--load", "y", "--save", "z"],
        ["--load", "x", "--to-hf", "y", "--dry-run"],
    ],
    ids=["no-save", "no-to-hf", "both-directions", "dry-run-backwards"],
)
def test_cli_bad_arguments_exit_2(argv):
    from megatron_hybrid.cli.main import main

    assert main(["convert", *argv]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--to-hf", "y", "--merge-lora", "--peft-format", "per_expert"], "--peft-format chooses"),
        (["--to-hf", "y", "--base-hf", "z"], "--base-hf goes with"),
    ],
    ids=["peft-format-without-to-peft", "base-hf-without-lora-export"],
)
def test_cli_lora_options_out_of_place_exit_2(argv, message, capsys):
    """LoRA export options that would be ignored are refused before anything is read."""
    from megatron_hybrid.cli.main import main

    assert main(["convert", "--load", "x", *argv]) == 2
    assert message in capsys.readouterr().err

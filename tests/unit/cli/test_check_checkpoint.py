"""``check-checkpoint``: GPT and hybrid checkpoints against patterns, from metadata only."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODEL_FLAGS = [
    "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--num-experts", "4", "--vocab-size", "128", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, megatron_cpu):
    """GPT (2 MoE layers), grouped '[*-][*E]' and Mamba 'M*-' checkpoints in Megatron's layout."""
    from megatron.core import dist_checkpointing

    from megatron_hybrid.testing.megatron_state import initialize_model_parallel
    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid, small_config

    root = tmp_path_factory.mktemp("ckpts")
    gpt_dir = root / "gpt" / "iter_0000007"
    gpt_dir.mkdir(parents=True)
    (root / "gpt" / "latest_checkpointed_iteration.txt").write_text("7")
    gpt = build_gpt_twin(small_config("[*E]{2}"), "[*E]{2}", initialize_model_parallel())
    dist_checkpointing.save(gpt.sharded_state_dict(), str(gpt_dir))

    hybrid_dir = root / "hybrid"
    hybrid_dir.mkdir()
    pattern = "[*-][*E]"
    hybrid = build_hybrid(small_config(pattern), pattern, initialize_model_parallel())
    dist_checkpointing.save(hybrid.sharded_state_dict(), str(hybrid_dir))

    # Mamba's in_proj and conv1d are saved as split parts (ShardedTensorFactory): z/x/B/C/dt.
    mamba_dir = root / "mamba"
    mamba_dir.mkdir()
    mamba = build_hybrid(small_config("M*-"), "M*-", initialize_model_parallel())
    dist_checkpointing.save(mamba.sharded_state_dict(), str(mamba_dir))
    return {"gpt": root / "gpt", "hybrid": hybrid_dir, "mamba": mamba_dir}


def _run(capsys, *argv):
    from megatron_hybrid.cli.main import main

    code = main(["check-checkpoint", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("which", "pattern", "code"),
    [
        pytest.param("gpt", "[*E]{2}", 0, id="gpt_into_grouped"),
        pytest.param("gpt", "[*E]|[*E]", 0, id="gpt_into_grouped_with_pipes"),
        pytest.param("hybrid", "[*-][*E]", 0, id="hybrid_into_same"),
        pytest.param("gpt", "[*E]{3}", 1, id="gpt_into_more_layers"),
        pytest.param("gpt", "*E*E", 1, id="gpt_into_ungrouped"),
        pytest.param("hybrid", "[*E][*-]", 1, id="hybrid_into_reordered"),
        pytest.param("mamba", "M*-", 0, id="mamba_into_same"),
        pytest.param("mamba", "*M-", 1, id="mamba_into_reordered"),
    ],
)
def test_exit_code_says_whether_it_loads(checkpoints, capsys, which, pattern, code):
    exit_code, out, _ = _run(
        capsys, "--load", str(checkpoints[which]), "--hybrid-layer-pattern", pattern, *MODEL_FLAGS
    )
    assert exit_code == code, out
    assert ("OK:" in out) == (code == 0)


def test_lists_missing_and_unexpected_keys(checkpoints, capsys):
    code, out, _ = _run(
        capsys, "--load", str(checkpoints["gpt"]), "--hybrid-layer-pattern", "*E*E", *MODEL_FLAGS
    )
    assert code == 1
    assert "missing from the checkpoint" in out
    assert "decoder.layers.3.mlp.router.weight" in out  # megatron-core's physical keys
    assert "in the checkpoint but not in the model" in out


def test_shape_mismatch_is_reported(checkpoints, capsys):
    flags = [f if f != "64" else "32" for f in MODEL_FLAGS]  # a different hidden size
    code, out, _ = _run(
        capsys, "--load", str(checkpoints["gpt"]), "--hybrid-layer-pattern", "[*E]{2}", *flags
    )
    assert code == 1
    assert "global shape differs" in out


def test_bad_directory_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "check-checkpoint", "--load", str(tmp_path),
         "--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "not a torch_dist checkpoint" in result.stderr
    assert "Traceback" not in result.stderr

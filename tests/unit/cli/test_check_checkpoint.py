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

    from megatron_hybrid.process_groups import initialize_model_parallel
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint written by `train` (it records its pattern), hidden size 32."""
    import os

    root = tmp_path_factory.mktemp("trained")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "train", "--hybrid-layer-pattern", "[*-][*E]",
         "--hidden-size", "32", "--num-experts", "4", "--swiglu", "--seq-length", "16",
         "--train-iters", "1", "--save", str(root)],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return root


def test_pattern_and_sizes_are_read_from_the_checkpoint(trained, capsys):
    code, out, err = _run(capsys, "--load", str(trained), "--num-experts", "4")
    assert code == 0, out + err
    assert "read from the checkpoint: --hybrid-layer-pattern='[*-][*E]' --hidden-size 32" in out
    assert "--swiglu" in out and "OK:" in out


def test_hidden_size_mismatch_is_named(trained, capsys):
    code, out, _ = _run(capsys, "--load", str(trained), "--num-experts", "4",
                        "--hidden-size", "64", "--ffn-hidden-size", "128")  # fmt: skip
    assert code == 1
    assert "NOT LOADABLE: --hidden-size 64 does not match the checkpoint's 32" in out
    assert "--hybrid-layer-pattern" not in out.splitlines()[-1]


def test_no_recorded_pattern_asks_for_one(checkpoints, capsys):
    code, _, err = _run(capsys, "--load", str(checkpoints["gpt"]), "--num-experts", "4")
    assert code == 2
    assert "records no layer pattern" in err and "pass --hybrid-layer-pattern" in err


def test_a_crash_is_not_reported_as_not_loadable(checkpoints, capsys, monkeypatch):
    """Exit 1 means 'does not load'; a model that cannot be built is bad input (2)."""
    from megatron_hybrid.model import expected_keys

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(expected_keys, "expected_checkpoint_tensors", broken)
    code, _, err = _run(capsys, "--load", str(checkpoints["gpt"]), "--hybrid-layer-pattern",
                        "[*E]{2}", *MODEL_FLAGS)  # fmt: skip
    assert code == 2 and "RuntimeError: boom" in err


def test_help_names_only_its_own_flags(capsys):
    from megatron_hybrid.cli.main import main

    assert main(["check-checkpoint", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--seq-length" not in out and "(default: read from the checkpoint)" in out

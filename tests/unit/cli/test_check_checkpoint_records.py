"""``check-checkpoint --load`` with no flags on every layout ``train`` writes: the checkpoint
records every model setting; flags given are compared with the record, mismatches named."""

from __future__ import annotations

import pytest

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

SMALL = ["--hidden-size", "32", "--num-attention-heads", "2", "--vocab-size", "64",
         "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1"]  # fmt: skip

# Each layout sets model flags that no tensor shape tells (top-k, norms, ranks, head dims).
LAYOUTS = {
    "dense": ["[*-]{2}", "--ffn-hidden-size", "48", "--qk-layernorm",
              "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm"],
    "moe": ["[*E]{2}", "--num-experts", "4", "--moe-ffn-hidden-size", "24",
            "--moe-shared-expert-intermediate-size", "16", "--moe-router-topk", "1",
            "--moe-router-pre-softmax"],
    "mla": ["[+-][+E]", "--num-experts", "4", "--q-lora-rank", "24", "--kv-lora-rank", "16",
            "--v-head-dim", "8", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4"],
    "gdn": ["[G-][*-]", "--swiglu", "--num-query-groups", "1"],
    "mamba": ["M*-", "--mamba-head-dim", "8", "--mamba-num-groups", "4", "--mamba-state-dim", "8"],
    "mtp": ["[*E]{2}/*E", "--num-experts", "4", "--kv-channels", "8"],
}  # fmt: skip


def _train_worker(rank, world_size, argv, record):
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import run
    from megatron_hybrid.training.train_settings import settings_from_args

    if not record:  # the negative control: a checkpoint without its settings record
        run.recorded_settings = lambda args, seq_length: None
    args = build_parser(load_commands()).parse_args(["train", *argv])
    return run.run_training(settings_from_args(args)).saved


def _train(root, layout: str, record: bool = True) -> None:
    pattern, *flags = LAYOUTS[layout]
    argv = ["--hybrid-layer-pattern", pattern, *SMALL, *flags, "--save", str(root)]
    (saved,) = run_distributed(_train_worker, 1, argv, record, timeout=400)
    assert saved is not None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    for layout in LAYOUTS:
        _train(root / layout, layout)
    return root


def _check(capsys, *argv):
    from megatron_hybrid.cli.main import main

    code = main(["check-checkpoint", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_flags_needed_on_any_train_layout(trained, capsys, layout):
    code, out, err = _check(capsys, "--load", str(trained / layout))
    assert code == 0, out + err
    assert "OK: every tensor of the model" in out
    pattern = LAYOUTS[layout][0]
    assert f"--hybrid-layer-pattern={pattern!r}" in out  # read from the record
    assert "given, unlike" not in out


def test_flags_given_are_compared_with_the_record(trained, capsys):
    code, out, _ = _check(capsys, "--load", str(trained / "moe"), "--num-experts", "8",
                          "--moe-router-topk", "1")  # fmt: skip
    assert code == 1
    # Only what differs is named (top-k 1 agrees with the record).
    assert (
        "given, unlike the checkpoint's record: --num-experts 8 (the checkpoint's: "
        "--num-experts 4)\n" in out
    )
    assert "NOT LOADABLE: --num-experts 8 does not match the checkpoint's 4" in out


def test_negative_control_without_the_record_flags_are_needed(tmp_path, capsys):
    """The same MoE run saved without its settings record: the expert size is no longer known
    (only the pattern, sizes and expert count that tensors and the pattern tell), so the check
    without flags fails, as it did before settings were recorded."""
    _train(tmp_path / "moe", "moe", record=False)
    code, out, err = _check(capsys, "--load", str(tmp_path / "moe"))
    assert code == 1, out + err
    assert "global shape differs" in out and "experts" in out

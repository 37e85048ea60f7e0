"""Each command takes the flags it reads, and no flag is accepted and then ignored: ``logprobs``
has its own list, model flags a source decides are refused by name, a ``train`` checkpoint's
record gives ``logprobs`` its model; the messages name the file, line or flag at fault."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from megatron_hybrid.testing.spawn import run_distributed

#: Snapshot: what ``logprobs`` reads (the model-shape flags, for checkpoints that record no
#: settings; the layout a forward pass runs on; the dtype; the sources).
LOGPROBS_OPTIONS = [
    "--bf16", "--disable-bias-linear", "--entropy", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--ffn-hidden-size", "--hidden-size",
    "--hybrid-layer-pattern", "--input", "--kv-channels", "--kv-lora-rank", "--load",
    "--load-hf", "--load-peft", "--mamba-head-dim", "--mamba-impl", "--mamba-num-groups",
    "--mamba-num-heads", "--mamba-state-dim", "--max-position-embeddings",
    "--max-tokens-per-micro-batch", "--moe-aux-loss-coeff", "--moe-ffn-hidden-size",
    "--moe-flex-dispatcher-backend", "--moe-grouped-gemm", "--moe-router-pre-softmax",
    "--moe-router-topk", "--moe-shared-expert-intermediate-size", "--moe-token-dispatcher-type",
    "--normalization", "--num-attention-heads", "--num-experts", "--num-query-groups",
    "--output", "--overwrite", "--pipeline-model-parallel-size", "--position-embedding-type",
    "--q-lora-rank",
    "--qk-head-dim", "--qk-layernorm", "--qk-pos-emb-head-dim", "--sequence-parallel",
    "--swiglu", "--temperature", "--tensor-model-parallel-size", "--transformer-impl",
    "--untie-embeddings-and-output-weights", "--v-head-dim", "--verbose", "--vocab-size",
]  # fmt: skip


def _subparser(name: str) -> argparse.ArgumentParser:
    from megatron_hybrid.cli.main import build_parser, load_commands

    parser = build_parser(load_commands())
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_logprobs_has_exactly_its_flags():
    options = sorted(o for o in _subparser("logprobs")._option_string_actions if o != "-h")
    assert [o for o in options if o != "--help"] == LOGPROBS_OPTIONS


@pytest.mark.parametrize(
    "flag", ["--lr", "--train-iters", "--save", "--lora-rank", "--seq-length",
             "--overlap-moe-expert-parallel-comm", "--context-parallel-size"],
)  # fmt: skip
def test_logprobs_refuses_train_only_flags(flag, capsys):
    from megatron_hybrid.cli.main import main

    assert main(["logprobs", "--input", "x.jsonl", "--load", "x", flag, "1"]) == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[1] / "hf"))
    import hf_oracle

    return hf_oracle.make_hf_checkpoint("qwen3_5", tmp_path_factory.mktemp("flags") / "hf")


@pytest.fixture
def jsonl(tmp_path):
    def write(content: bytes):
        path = tmp_path / "in.jsonl"
        path.write_bytes(content)
        return str(path)

    return write


def _refused(capsys, *argv) -> str:
    from megatron_hybrid.cli.main import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


@pytest.mark.parametrize("command", ["train", "logprobs"])
def test_model_flags_a_hugging_face_config_decides_are_refused(command, hf, jsonl, capsys):
    extra = ["--input", jsonl(b'{"input_ids": [1, 2]}\n')] if command == "logprobs" else []
    err = _refused(capsys, command, "--load-hf", str(hf), "--hidden-size", "128",
                   "--qk-head-dim", "8", "--transformer-impl", "local", *extra)  # fmt: skip
    assert "--hidden-size 128 (the model's: 64)" in err
    assert "--qk-head-dim (the config decides it)" in err and "--transformer-impl" not in err


def test_model_flags_that_agree_with_the_config_are_kept(hf):
    from megatron_hybrid.training.hf_source import hf_source
    from megatron_hybrid.training.train_settings import settings_from_args

    args = _subparser("train").parse_args(["--load-hf", str(hf), "--hidden-size", "64"])
    args = settings_from_args(args)
    assert hf_source(args).applied_to(args).hidden_size == 64  # what the model has


@pytest.mark.parametrize("command", ["train", "logprobs"])
def test_load_of_a_hugging_face_folder_points_to_load_hf(command, hf, jsonl, capsys):
    extra = ["--input", jsonl(b'{"input_ids": [1, 2]}\n')] if command == "logprobs" else []
    err = _refused(capsys, command, "--load", str(hf), *extra)
    assert f"--load {hf} is a Hugging Face folder" in err and f"--load-hf {hf}" in err
    assert "--hybrid-layer-pattern is required" not in err


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"input_ids": [1, 2]}\n{"input_ids": [3, 1000000000000000000000000000000]}\n',
         r"line 2 holds token id 1000000000000000000000000000000, beyond any vocabulary"),
        (b'{"input_ids": [1, 2]}\n\n{"input_ids": [3, \xff]}\n', "line 3 is not UTF-8"),
        (b'{"input_ids": [1, 2]}\n{"input_ids": [3, 256]}\n',
         r"line 2 holds token id 256, outside the model's vocabulary \[0, 256\)"),
    ],
    ids=["id-beyond-int64", "not-utf8", "id-past-vocab"],
)  # fmt: skip
def test_bad_input_names_the_file_and_line(content, message, hf, jsonl, capsys, pg):
    import re

    path = jsonl(content)
    err = _refused(capsys, "logprobs", "--load-hf", str(hf), "--input", path)
    assert path in err and re.search(message, err), err


def test_load_peft_needs_its_base(jsonl, capsys):
    err = _refused(capsys, "logprobs", "--load-peft", "adapter", "--input",
                   jsonl(b'{"input_ids": [1, 2]}\n'))  # fmt: skip
    assert "--load-peft adapter applies a PEFT adapter to its base: add --load-hf" in err


# --- a train checkpoint: its record gives logprobs the model; a changed --seq-length is named --


def _batch_worker(rank, world_size, commands):
    from megatron_hybrid.cli.main import main

    out = []
    for argv in commands:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        out.append((code, stdout.getvalue(), stderr.getvalue()))
    return out


def test_train_checkpoints_give_logprobs_their_model(tmp_path):
    run = str(tmp_path / "run")
    source = tmp_path / "in.jsonl"
    source.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    model = ["--hybrid-layer-pattern", "[*-]", "--position-embedding-type", "learned_absolute",
             "--hidden-size", "32", "--num-attention-heads", "2"]  # fmt: skip
    commands = [
        ["train", *model, "--train-iters", "1", "--seq-length", "48", "--save", run],
        # No model flags: the run's record gives them (the pattern too).
        ["logprobs", "--load", run, "--input", str(source), "--output", str(tmp_path / "a")],
        # The same flags as the run: accepted, same numbers.
        ["logprobs", "--load", run, *model, "--input", str(source),
         "--output", str(tmp_path / "b")],  # fmt: skip
        ["logprobs", "--load", run, "--hidden-size", "64", "--input", str(source)],
        # Learned positions follow --seq-length: the resume names it, not --hidden-size.
        ["train", *model, "--load", run, "--train-iters", "2", "--seq-length", "32"],
    ]
    done = run_distributed(_batch_worker, 1, commands, timeout=600)[0]
    assert [code for code, *_ in done] == [0, 0, 0, 2, 2], [err[-800:] for *_, err in done]
    first = [json.loads(line) for line in (tmp_path / "a").read_text().splitlines()]
    assert len(first) == 2 and len(first[0]["logprobs"]) == 2
    assert (tmp_path / "b").read_text() == (tmp_path / "a").read_text()
    assert "--hidden-size 64 (the checkpoint's: --hidden-size 32)" in done[3][2]
    resume = done[4][2]
    assert "--seq-length 32 sets the number of learned absolute positions" in resume
    assert "the checkpoint has 48" in resume and "--hidden-size" not in resume

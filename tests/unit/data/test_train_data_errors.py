"""``train --data-path``: every bad input is refused by name before training, exit code 2 and
one message (no traceback)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import random_documents, write_indexed

MODEL = ["--hybrid-layer-pattern", "[*-]", "--hidden-size", "32", "--num-attention-heads", "2",
         "--train-iters", "2", "--seq-length", "16", "--micro-batch-size", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("errors")
    write_indexed(folder / "good", random_documents(30, 500))
    write_indexed(folder / "big", [np.array([1, 2, 700, 3])] + random_documents(30, 500))
    write_indexed(folder / "only", random_documents(5, 500))
    (folder / "only.idx").unlink()
    return folder


CASES = [
    pytest.param(["--data-path", "{d}/missing", "--tokenizer-model", "{t}"],
                 "--data-path {d}/missing: {d}/missing.bin and {d}/missing.idx not found",
                 id="missing_files"),
    pytest.param(["--data-path", "{d}/only", "--tokenizer-model", "{t}"],
                 "--data-path {d}/only: {d}/only.idx not found", id="missing_idx"),
    pytest.param(["--data-path", "{d}/good"],
                 "--data-path needs the tokenizer the data was prepared with: add "
                 "--tokenizer-model HF_DIR", id="no_tokenizer"),
    pytest.param(["--data-path", "{d}/good", "--tokenizer-model", "{t}", "--vocab-size", "256",
                  "--split", "9,1,0"],
                 "the tokenizer {t} has 512 tokens, more than the model's vocabulary of 256",
                 id="tokenizer_larger_than_vocab"),
    pytest.param(["--data-path", "0.5", "{d}/good", "0.5"],
                 "--data-path: '0.5' stands where a prefix belongs", id="odd_blend"),
    pytest.param(["--data-path", "{d}/good", "--tokenizer-model", "{t}", "--split", "9,1,1,1"],
                 "--split '9,1,1,1': give up to three non-negative proportions", id="bad_split"),
    pytest.param(["--split", "98,2,0"], "--split divides --data-path; give --data-path too",
                 id="split_without_data"),
    pytest.param(["--data-path", "{d}/good", "--tokenizer-model", "{t}", "--split", "100,0,0",
                  "--eval-interval", "1"], "--eval-interval needs a validation split",
                 id="eval_without_validation"),
    pytest.param(["--data-path", "{d}/good", "--tokenizer-model", "{t}"],
                 "--split 969, 30, 1 leaves the test split of {d}/good (30 documents) no "
                 "document (megatron-core would build it forever): give the test split a larger "
                 "share or none", id="empty_test_split_of_the_default"),
    pytest.param(["--lr-warmup-iters", "2"], "--lr-warmup-iters 2 must be below "
                 "--lr-decay-iters 2", id="warmup_past_decay"),
    pytest.param(["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr 0.001 is above --lr 0.0001",
                 id="min_lr_above_lr"),
    pytest.param(["--tokenizer-model", "{d}"], "--tokenizer-model {d} holds no Hugging Face "
                 "tokenizer", id="not_a_tokenizer"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), CASES)
def test_refused_before_training(data, tokenizer_dir, argv, message, capsys):
    from megatron_hybrid.cli.main import main

    fill = {"d": data, "t": tokenizer_dir}
    code = main(["train", *MODEL, *(a.format(**fill) for a in argv)])
    out, err = capsys.readouterr()
    assert code == 2
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message.format(**fill) in errors[0], err
    assert "step" not in out


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed here")  # fmt: skip
def test_tensorboard_dir_without_tensorboard(tmp_path, capsys):
    from megatron_hybrid.cli.main import main

    assert main(["train", *MODEL, "--tensorboard-dir", str(tmp_path)]) == 2
    assert "pip install 'megatron_hybrid[tensorboard]'" in capsys.readouterr().err


@pytest.mark.slow
def test_token_id_beyond_the_vocabulary_exits_2(data, tokenizer_dir):
    """Checked on rank 0 once the job runs, refused on every rank before the first step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "train", *MODEL, "--data-path",
         str(data / "big"), "--tokenizer-model", str(tokenizer_dir), "--split", "9,1,0"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    assert errors[0].endswith(
        f"--data-path {data / 'big'}: token id 700 is beyond the model's vocabulary of 512; the "
        "data was prepared with another tokenizer (prepare it again with --tokenizer-model of "
        "this model)"
    )
    assert "step" not in result.stdout


def test_a_hugging_face_folder_brings_its_tokenizer(data, tokenizer_dir):
    """``--load-hf`` folders are the default tokenizer; the model's vocabulary stays theirs and
    a tokenizer larger than it is refused, naming where the vocabulary comes from."""
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.inputs import resolve_data
    from megatron_hybrid.training.settings import SettingsError
    from megatron_hybrid.training.train_settings import settings_from_args

    argv = ["train", *MODEL, "--data-path", str(data / "good"), "--split", "9,1,0"]
    parsed = settings_from_args(build_parser(load_commands()).parse_args(argv))
    args = dataclasses.replace(parsed, vocab_size=1024)  # what HFSource.applied_to sets
    hf = str(tokenizer_dir)
    resolved = resolve_data(args, hf_folder=hf, vocab_from="the Hugging Face model's")
    assert (resolved.tokenizer_model, resolved.vocab_size) == (hf, 1024)
    args = dataclasses.replace(parsed, vocab_size=300)
    with pytest.raises(
        SettingsError,
        match=r"has 512 tokens, more than the model's vocabulary "
        r"of 300 \(the Hugging Face model's\): pass the model's own tokenizer",
    ):
        resolve_data(args, hf_folder=hf, vocab_from="the Hugging Face model's")
    # Without one of its own (and no --tokenizer-model), --data-path says where it looked.
    args = dataclasses.replace(parsed, vocab_size=None)
    with pytest.raises(SettingsError, match=f"add --tokenizer-model HF_DIR \\({data} holds none"):
        resolve_data(args, hf_folder=str(data))

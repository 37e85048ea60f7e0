"""Folders the package writes for Hugging Face users: complete or untouched, never a source,
and loadable by transformers as they are.

* ``convert --load CKPT --to-hf`` of a checkpoint converted from a folder with a tokenizer
  writes the tokenizer, chat template and generation config too (the checkpoint carries them in
  ``hf_files/``); transformers is the oracle: ``AutoTokenizer``, ``GenerationConfig`` and
  ``AutoModelForCausalLM`` load the folder and give the source's tokens, settings and logits.
* Fault injection: every writer (``save_hf_checkpoint``, ``save_peft_adapter``, ``logprobs
  --output``) is interrupted at its first, middle and last file, at a side file and at each
  rename into place (and by Ctrl-C): the target is the old folder every time, nothing is left
  beside it, and the re-run writes the complete new one.
* Every failure of input or the file system is one message and exit code 2 (130 for Ctrl-C),
  checked before any work where it can be.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import hf_oracle
import pytest
import torch

from megatron_hybrid.checkpointing.outputs import (
    OutputError,
    OutputInterrupted,
    OutputWriteError,
)
from megatron_hybrid.hf import load_hf_model, save_hf_checkpoint

FAMILY = "qwen3_5"
WEIGHTS = (".safetensors", "model.safetensors.index.json")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A tiny sharded Qwen3.5 folder with a tokenizer, chat template and generation config."""
    folder = hf_oracle.make_hf_checkpoint(
        FAMILY, tmp_path_factory.mktemp("served") / "hf", max_shard_size="40KB"
    )
    return hf_oracle.add_serving_files(folder)


@pytest.fixture(scope="module")
def converted(served, tmp_path_factory, megatron_cpu) -> Path:
    """``convert --from-hf served --save CKPT`` (in this process, megatron state reset after)."""
    from megatron_hybrid.cli.main import main
    from megatron_hybrid.process_groups import reset_megatron_state

    ckpt = tmp_path_factory.mktemp("converted") / "ckpt"
    try:
        assert main(["convert", "--from-hf", str(served), "--save", str(ckpt)]) == 0
    finally:
        reset_megatron_state()
    return ckpt


def snapshot(path: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``path`` ({} if missing)."""
    if not path.exists():
        return {}
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def serving_files(folder: Path) -> dict[str, bytes]:
    """The files beside config.json and the weights."""
    files = snapshot(folder)
    return {n: b for n, b in files.items() if n != "config.json" and not n.endswith(WEIGHTS)}


def beside(target: Path) -> list[str]:
    """The leftovers of writing ``target`` beside it (staging or set-aside siblings)."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``python -m megatron_hybrid ARGV`` in this process (the
    erased progress bar left out)."""
    from megatron_hybrid.cli.main import main

    code = main(list(argv))
    captured = capsys.readouterr()
    shown = [line.rsplit("\r", 1)[-1] for line in captured.err.split("\n")]
    return code, captured.out, "\n".join(line for line in shown if line.strip())


# --- what serving needs --------------------------------------------------------------------


def assert_serves_like(out: Path, source: Path) -> None:
    """transformers reads ``out`` as ``source``: the same files beside the weights, tokens,
    chat rendering, generation settings and logits."""
    from transformers import AutoTokenizer, GenerationConfig

    assert serving_files(out) == serving_files(source)  # every file, byte for byte
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    text = "the hybrid model reads every export"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "hello world"}]
    rendered = ours.apply_chat_template(chat, tokenize=False)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False)
    generation = GenerationConfig.from_pretrained(out).to_dict()
    assert generation == GenerationConfig.from_pretrained(source).to_dict()
    ids = torch.tensor([theirs(text)["input_ids"]])
    assert torch.equal(hf_oracle.hf_logits(out, ids), hf_oracle.hf_logits(source, ids))


def test_a_converted_checkpoint_exports_what_serving_needs(served, converted, tmp_path, pg, capsys):
    release = converted / "release"
    manifest = json.loads((release / "integrity.json").read_text())["files"]
    assert "hf_files/tokenizer.json" in manifest and "hf_files/chat_template.jinja" in manifest
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "--load", str(converted), "--to-hf", str(out))
    assert code == 0, err
    assert_serves_like(out, served)


def test_negative_control_a_checkpoint_without_its_files_exports_no_tokenizer(
    served, tmp_path, pg, capsys, monkeypatch
):
    """The checkpoint's carried files switched off (as convert wrote checkpoints before): the
    export lacks the tokenizer and the generation settings, and the check above fails."""
    from megatron_hybrid.hf import dist as hf_dist

    monkeypatch.setattr(hf_dist, "carried_files", lambda model: {})
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert run(capsys, "convert", "--from-hf", str(served), "--save", str(ckpt))[0] == 0
    assert run(capsys, "convert", "--load", str(ckpt), "--to-hf", str(out))[0] == 0
    assert "tokenizer.json" not in serving_files(out)
    with pytest.raises(AssertionError):
        assert_serves_like(out, served)


def test_a_source_without_generation_config_gets_one(served, tmp_path, pg):
    """transformers' ``save_pretrained`` always writes one; an export of a source without it
    makes it from config.json, so ``GenerationConfig.from_pretrained`` loads every export."""
    from transformers import GenerationConfig

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(served / "tokenizer.json", bare)
    model = load_hf_model(served)
    save_hf_checkpoint(model, tmp_path / "out", source_path=bare)
    assert sorted(serving_files(tmp_path / "out")) == ["generation_config.json", "tokenizer.json"]
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {
        "_from_model_config": True
    }
    GenerationConfig.from_pretrained(tmp_path / "out")


# --- fault injection -----------------------------------------------------------------------


class Fault:
    """Make the ``n``-th call of ``owner.name`` (the calls matching ``when``) raise ``error``."""

    def __init__(self, owner, name: str, n: int, error: BaseException, when=lambda *a: True):
        self.owner, self.name, self.n, self.error, self.when = owner, name, n, error, when

    def install(self, monkeypatch) -> None:
        real = getattr(self.owner, self.name)
        seen = [0]

        def faulty(*args, **kwargs):
            if self.when(*args):
                seen[0] += 1
                if seen[0] == self.n:
                    raise self.error
            return real(*args, **kwargs)

        monkeypatch.setattr(self.owner, self.name, faulty)


def full_disk() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_faults_leave_the_old_folder(faults: dict, write, target: Path, monkeypatch) -> None:
    """Each fault: the write raises one of the package's errors, ``target`` is byte for byte as
    it was, and nothing is left beside it."""
    old = snapshot(target)
    assert old, "the target must hold an old version to be kept"
    for name, fault in faults.items():
        with monkeypatch.context() as patch:
            fault.install(patch)
            with pytest.raises((OutputWriteError, OutputInterrupted)):
                write()
        assert snapshot(target) == old, name
        assert beside(target) == [], name


def _shards(folder: Path) -> int:
    return sum(1 for name in snapshot(folder) if name.endswith(".safetensors"))


def test_every_fault_of_an_export_leaves_the_old_folder(served, tmp_path, pg, monkeypatch):
    import safetensors.torch

    model = load_hf_model(served)
    reference = save_hf_checkpoint(model, tmp_path / "reference", max_shard_size="100KB")
    shards = _shards(reference)
    assert shards >= 3
    out = tmp_path / "out"
    save_hf_checkpoint(model, out, max_shard_size="60KB")  # the old folder: other shards
    assert _shards(out) != shards

    def write():
        save_hf_checkpoint(model, out, max_shard_size="100KB", overwrite=True)

    faults = {
        "first shard": Fault(safetensors.torch, "save_file", 1, full_disk()),
        "middle shard": Fault(safetensors.torch, "save_file", shards // 2 + 1, full_disk()),
        "last shard": Fault(safetensors.torch, "save_file", shards, full_disk()),
        "ctrl-c at the middle shard": Fault(
            safetensors.torch, "save_file", shards // 2 + 1, KeyboardInterrupt()
        ),
        "a side file": Fault(shutil, "copyfile", 2, PermissionError(errno.EACCES, "denied")),
        "moving the old folder aside": Fault(os, "rename", 1, full_disk()),
        "moving the new folder in": Fault(os, "rename", 2, full_disk()),
    }
    assert_faults_leave_the_old_folder(faults, write, out, monkeypatch)
    write()  # the re-run
    assert snapshot(out) == snapshot(reference) and beside(out) == []


def test_every_fault_of_an_adapter_export_leaves_the_old_folder(served, tmp_path, pg, monkeypatch):
    import pathlib

    import safetensors.torch

    from megatron_hybrid.peft import LoRAConfig, apply_lora, save_peft_adapter

    model = load_hf_model(served)
    apply_lora(model, LoRAConfig(rank=2, alpha=4))
    reference = save_peft_adapter(model, tmp_path / "reference")
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"an older adapter")
    (out / "README.md").write_text("old")

    def write():
        save_peft_adapter(model, out, overwrite=True)

    def is_config(path, *args):
        return str(path).endswith("adapter_config.json")

    faults = {
        "the weights": Fault(safetensors.torch, "save_file", 1, full_disk()),
        "the config": Fault(pathlib.Path, "write_text", 1, full_disk(), when=is_config),
        "ctrl-c at the config": Fault(
            pathlib.Path, "write_text", 1, KeyboardInterrupt(), when=is_config
        ),
        "moving the old folder aside": Fault(os, "rename", 1, full_disk()),
        "moving the new folder in": Fault(os, "rename", 2, full_disk()),
    }
    assert_faults_leave_the_old_folder(faults, write, out, monkeypatch)
    with pytest.raises(OutputError, match="is the base"):
        save_peft_adapter(model, served, overwrite=True)
    write()
    assert snapshot(out) == snapshot(reference) and beside(out) == []
    # A hub id as the base names no folder here: an output at the same relative path is new.
    monkeypatch.chdir(tmp_path)
    save_peft_adapter(model, "org/model", base_model_name_or_path="org/model")
    config = json.loads((tmp_path / "org" / "model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/model"


def test_every_fault_of_logprobs_output_leaves_the_old_file(
    served, tmp_path, pg, capsys, monkeypatch
):
    import pathlib

    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"input_ids": [1, 5, 9, 4]}\n{"input_ids": [3, 3]}\n')
    reference, out = tmp_path / "reference.jsonl", tmp_path / "scores.jsonl"
    command = ["logprobs", "--input", str(inputs), "--load-hf", str(served), "--output"]
    assert run(capsys, *command, str(reference))[0] == 0
    out.write_text("old\n")

    def write():
        code, _, err = run(capsys, *command, str(out), "--overwrite")
        if code == 2 and "No space left on device" in err and len(err.splitlines()) == 1:
            raise OutputWriteError(err)
        if code == 130 and "interrupted while writing" in err:
            raise OutputInterrupted(err)
        raise AssertionError(f"exit {code}: {err}")

    def is_staged(path, *args):
        return ".scores.jsonl.partial-" in str(path)

    faults = {
        "the file": Fault(pathlib.Path, "write_text", 1, full_disk(), when=is_staged),
        "ctrl-c at the file": Fault(
            pathlib.Path, "write_text", 1, KeyboardInterrupt(), when=is_staged
        ),
        "moving it into place": Fault(os, "replace", 1, full_disk(), when=is_staged),
    }
    assert_faults_leave_the_old_folder(faults, write, out, monkeypatch)
    assert run(capsys, *command, str(out), "--overwrite")[0] == 0  # the re-run
    assert out.read_text() == reference.read_text() and beside(out) == []


# --- one message, exit 2, before any work -------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Building a model or scoring fails the test: a refusal must come before either."""
    from megatron_hybrid.hf import api as hf_api
    from megatron_hybrid.training import logprobs_job

    def work(*args, **kwargs):
        raise AssertionError("work started before the output was checked")

    monkeypatch.setattr(hf_api, "build_model", work)
    monkeypatch.setattr(hf_api, "load_hf_model", work)
    monkeypatch.setattr(logprobs_job, "build_chunks", work)
    monkeypatch.setattr(logprobs_job, "forward_logprobs", work)


def _one_message(code: int, err: str, *texts: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    # One message (a library's warning, shown when pytest's warning capture is off, aside).
    (line,) = [x for x in err.splitlines() if "Warning: " not in x and not x.startswith("  ")]
    assert ": error: " in line
    for text in texts:
        assert text in line, line


def test_convert_refuses_bad_outputs_before_any_work(
    served, converted, tmp_path, pg, capsys, no_work, monkeypatch
):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    full = tmp_path / "full"
    (full / "sub").mkdir(parents=True)
    (full / "sub" / "old.bin").write_bytes(b"old")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != readonly and real_access(p, m))
    load = ["convert", "--load", str(converted), "--to-hf"]
    cases = [
        ([*load, str(a_file)], [f"--to-hf {a_file} is a file; give a folder"]),
        ([*load, str(readonly / "out")], [f"{readonly} is not writable"]),
        ([*load, str(full)], [f"--to-hf {full}: the folder is not empty; pass --overwrite"]),
        ([*load, str(served), "--overwrite"],
         [f"--to-hf {served} is the Hugging Face folder {converted} was converted from",
          "--overwrite does not change this"]),
        ([*load, str(converted / "release"), "--overwrite"], [f"lies inside --load {converted}"]),
        (["convert", "--from-hf", str(served), "--save", str(served / "ckpt"), "--overwrite"],
         [f"--save {served / 'ckpt'} lies inside --from-hf {served}"]),
        (["convert", "--from-hf", str(served), "--save", str(full)],
         [f"--save {full}: the folder is not empty; pass --overwrite"]),
    ]  # fmt: skip
    for argv, texts in cases:
        code, out, err = run(capsys, *argv)
        _one_message(code, err, *texts)
    assert snapshot(full) == {"sub/old.bin": b"old"} and list(readonly.iterdir()) == []
    assert a_file.read_text() == "x"


def test_convert_on_a_full_disk_is_one_message_and_the_rerun_works(
    served, converted, tmp_path, pg, capsys, monkeypatch
):
    """A full disk while ``--to-hf`` writes shards, or while ``--save`` writes megatron-core's
    data: one message, the target untouched, no advice to use a flag the command lacks, and the
    same command run again succeeds. Ctrl-C: exit 130, one line, the target untouched."""
    import safetensors.torch
    from megatron.core import dist_checkpointing

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    to_hf = ["convert", "--load", str(converted), "--to-hf", str(out)]
    save = ["convert", "--from-hf", str(served), "--save", str(ckpt)]
    for argv, owner, name in ((to_hf, safetensors.torch, "save_file"),
                              (save, dist_checkpointing, "save")):  # fmt: skip
        with monkeypatch.context() as patch:
            Fault(owner, name, 1, full_disk()).install(patch)
            code, _, err = run(capsys, *argv)
        _one_message(code, err, "No space left on device", "it is left as it was")
        assert "--overwrite-checkpoint" not in err
        assert not out.exists() and not ckpt.exists() and beside(out) == []
    with monkeypatch.context() as patch:
        Fault(safetensors.torch, "save_file", 1, KeyboardInterrupt()).install(patch)
        code, _, err = run(capsys, *to_hf)
    assert code == 130 and err == (
        f"python -m megatron_hybrid convert: interrupted while writing {out}; it is left as it was"
    )
    assert not out.exists() and beside(out) == []
    for argv in (to_hf, save):
        code, _, err = run(capsys, *argv)
        assert code == 0, err
    assert (out / "tokenizer.json").is_file() and (ckpt / "release" / "metadata.json").is_file()


def test_logprobs_refuses_bad_outputs_before_scoring(served, tmp_path, pg, capsys, no_work):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"input_ids": [1, 5, 9, 4]}\n')
    taken = tmp_path / "taken.jsonl"
    taken.write_text("old\n")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"input_ids": [1]}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    command = ["logprobs", "--load-hf", str(served), "--input"]
    cases = [
        ([*command, str(inputs), "--output", str(inputs), "--overwrite"],
         [f"--output {inputs} is --input {inputs}, which this command reads"]),
        ([*command, str(inputs), "--output", str(tmp_path / "nope" / "o.jsonl")],
         [f"the folder {tmp_path / 'nope'} does not exist"]),
        ([*command, str(inputs), "--output", str(taken)],
         [f"--output {taken}: the file exists; pass --overwrite"]),
        ([*command, str(inputs), "--output", str(served / "scores.jsonl")],
         [f"lies inside --load-hf {served}"]),
        ([*command, str(latin)], [f"{latin} line 2 is not UTF-8 text (byte 0xe9"]),
    ]  # fmt: skip
    for argv, texts in cases:
        code, out, err = run(capsys, *argv)
        _one_message(code, err, *texts)
    assert inputs.read_text() == '{"input_ids": [1, 5, 9, 4]}\n' and taken.read_text() == "old\n"


def test_train_never_saves_into_its_source(served, tmp_path, pg, capsys):
    before = snapshot(served)
    for argv in (["--save", str(served), "--overwrite"], ["--save", str(served / "run")]):
        code, _, err = run(capsys, "train", "--load-hf", str(served), "--train-iters", "1", *argv)
        _one_message(code, err, f"--load-hf {served}", "--overwrite does not change this")
    assert snapshot(served) == before


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        pytest.param(lambda f: os.truncate(f / "adapter_model.safetensors", 100),
                     r"adapter_model\.safetensors is damaged \(.*\): it is not a complete "
                     "safetensors file", id="truncated-weights"),
        pytest.param(lambda f: (f / "adapter_config.json").write_text("[1, 2]"),
                     r"adapter_config\.json holds a JSON list, not the object of LoraConfig fields",
                         id="config-a-list"),
        pytest.param(lambda f: (f / "adapter_config.json").write_bytes(b'{"r": 2,'),
                     r"adapter_config\.json line 1 column 9 is not valid JSON",
                     id="config-cut-short"),
    ],
)  # fmt: skip
def test_a_damaged_adapter_is_one_message_naming_its_file(
    served, tmp_path, pg, capsys, damage, match
):
    from megatron_hybrid.peft import LoRAConfig, apply_lora, load_peft_adapter, save_peft_adapter
    from megatron_hybrid.peft.load import PeftAdapterError

    model = load_hf_model(served)
    apply_lora(model, LoRAConfig(rank=2, alpha=4))
    adapter = save_peft_adapter(model, tmp_path / "adapter")
    damage(adapter)
    with pytest.raises(PeftAdapterError, match=rf"{adapter}/{match}"):
        load_peft_adapter(load_hf_model(served), adapter)
    code, _, err = run(capsys, "train", "--load-hf", str(served), "--load-peft", str(adapter),
                       "--train-iters", "1")  # fmt: skip
    _one_message(code, err, str(adapter))


@pytest.mark.parametrize("views", [True, False], ids=["expert-rows", "own-storage"])
def test_the_writer_saves_rows_of_one_storage_each_on_its_own(tmp_path, views):
    """Expert weights built into one storage (``GroupedGemmExperts``) reach the safetensors
    writer as views of it: each is written as itself (safetensors refuses only overlapping
    memory), and the file holds no more than the tensors."""
    from safetensors.torch import load_file

    from megatron_hybrid.hf.io import HFCheckpointWriter

    stack = torch.arange(4 * 6 * 8, dtype=torch.float32).view(4, 6, 8)
    tensors = {f"experts.{e}.w": stack[e] if views else stack[e].clone() for e in range(4)}
    writer = HFCheckpointWriter(tmp_path / "out")
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    (name,) = writer.close()
    loaded = load_file(tmp_path / "out" / name)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert (tmp_path / "out" / name).stat().st_size < stack.nbytes + 1024

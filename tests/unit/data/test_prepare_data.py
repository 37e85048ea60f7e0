"""``prepare-data``: the .bin holds exactly the tokenizer's ids (+ EOD), chat rows get the
assistant-only loss mask transformers itself computes, and every bad input exits 2 with one
message and leaves nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import ANSWER, chat_rows

from megatron_hybrid.testing.tokenizers import text_rows, write_jsonl


def prepare(*argv: str) -> int:
    from megatron_hybrid.cli.main import main

    return main(["prepare-data", *map(str, argv)])


def read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    # Copies: the arrays view the data set's memory map, which closes with it.
    return [np.array(dataset[i]) for i in range(len(dataset))]


def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("workers", [1, 2], ids=["in_process", "two_workers"])
def test_bin_holds_the_tokenizers_ids_and_eod(tmp_path, tokenizer_dir, workers, capsys):
    first = write_jsonl(tmp_path / "a.jsonl", text_rows(700, seed=1))  # more than one chunk
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": ""}, *text_rows(30, seed=2)])
    assert prepare("--input", first, second, "--output-prefix", tmp_path / "out",
                   "--tokenizer-model", tokenizer_dir, "--append-eod",
                   "--workers", workers) == 0  # fmt: skip
    tok = tokenizer(tokenizer_dir)
    rows = [json.loads(line) for path in (first, second) for line in open(path)]
    # Megatron-LM's HuggingFaceTokenizer: tokenizer(text).input_ids and the EOD; an empty
    # document gets no EOD and no sequence (Megatron-LM's layout).
    expected = [tok(r["text"]).input_ids + [tok.eos_token_id] for r in rows if r["text"]]
    stored = [d.tolist() for d in read(tmp_path / "out_text_document")]
    assert stored == expected
    assert stored != [ids[:-1] for ids in expected]  # control: the EOD is there
    assert not list(tmp_path.glob("*_loss_mask*"))  # text only: no loss mask
    summary = capsys.readouterr().out
    assert f"prepared 731 documents ({sum(map(len, expected)):,} tokens)" in summary


def test_megatron_dtype_choice(tmp_path, tokenizer_dir):
    """uint16 below 65,500 tokens, as Megatron-LM's DType.optimal_dtype chooses."""
    write_jsonl(tmp_path / "a.jsonl", text_rows(5))
    assert prepare("--input", tmp_path / "a.jsonl", "--output-prefix", tmp_path / "o",
                   "--tokenizer-model", tokenizer_dir) == 0  # fmt: skip
    assert read(tmp_path / "o_text_document")[0].dtype == np.uint16


@pytest.mark.parametrize("turns", [1, 3], ids=["one_turn", "three_turns"])
def test_chat_masks_equal_transformers_assistant_mask(
    tmp_path, tokenizer_dir, generation_tokenizer_dir, turns
):
    """The prefix-by-prefix spans (a template without {% generation %}) and the template's own
    generation marks both give transformers' ``return_assistant_tokens_mask``."""
    rows = chat_rows(40, seed=turns, turns=turns)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    for name, folder in (("plain", tokenizer_dir), ("tagged", generation_tokenizer_dir)):
        assert prepare("--input", tmp_path / "chat.jsonl", "--output-prefix", tmp_path / name,
                       "--tokenizer-model", folder, "--json-keys", "messages") == 0  # fmt: skip
    reference = tokenizer(generation_tokenizer_dir)
    plain, plain_mask = (read(tmp_path / f"plain_messages_document{s}") for s in ("", "_loss_mask"))
    tagged_mask = read(tmp_path / "tagged_messages_document_loss_mask")
    for i, row in enumerate(rows):
        out = reference.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)  # fmt: skip
        assert plain[i].tolist() == out["input_ids"]
        assert plain_mask[i].tolist() == out["assistant_masks"] == tagged_mask[i].tolist()
        kept = reference.decode(plain[i][plain_mask[i].astype(bool)])
        assert kept == f"{ANSWER}<|im_end|>\n" * turns
    # Control: the masks are not trivial.
    assert 0 < plain_mask[0].mean() < 0.5


def test_text_and_chat_rows_under_one_key(tmp_path, tokenizer_dir):
    """A data set whose first chat row comes late: earlier text rows are trained on whole, the
    EOD after a chat is not trained on."""
    rows = [{"messages": "plain text first"}, *chat_rows(2), {"messages": "text again"}]
    write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert prepare("--input", tmp_path / "mixed.jsonl", "--output-prefix", tmp_path / "m",
                   "--tokenizer-model", tokenizer_dir, "--json-keys", "messages",
                   "--append-eod") == 0  # fmt: skip
    tokens = read(tmp_path / "m_messages_document")
    masks = read(tmp_path / "m_messages_document_loss_mask")
    assert [len(t) for t in tokens] == [len(m) for m in masks]
    assert masks[0].all() and masks[3].all()
    assert masks[1][-1] == 0 and 0 < masks[1].sum() < len(masks[1]) - 1


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


BAD_ROWS = [
    pytest.param('{"text": "fine"}\n{"text": "broken\n', "b.jsonl:2: not valid JSON",
                 id="malformed_json"),
    pytest.param('{"text": "fine"}\n["a list"]\n', "b.jsonl:2: expected a JSON object",
                 id="not_an_object"),
    pytest.param('{"txt": "typo"}\n', "b.jsonl:1: no 'text' key (the row has ['txt'])",
                 id="missing_key"),
    pytest.param('{"messages": []}\n', "b.jsonl:1: no 'text' key (the row has ['messages']) "
                 "(a chat file: pass --json-keys messages)", id="chat_without_json_keys"),
    pytest.param('{"text": 3}\n', "b.jsonl:1: 'text' holds int", id="not_text"),
    pytest.param('{"text": [{"role": "user", "content": "hi"}]}\n',
                 "b.jsonl:1: 'text': the conversation has no \"assistant\" message",
                 id="no_assistant"),
    pytest.param('{"text": [{"role": "user"}, {"role": "assistant", "content": "x"}]}\n',
                 "b.jsonl:1: 'text': message 0 needs a string \"role\" and a string \"content\"",
                 id="no_content"),
]  # fmt: skip


@pytest.mark.parametrize(("second", "message"), BAD_ROWS)
def test_bad_line_exits_2_naming_file_and_line_and_writes_nothing(
    tmp_path, tokenizer_dir, second, message, capsys
):
    write_jsonl(tmp_path / "a.jsonl", text_rows(600))  # a whole chunk written before the error
    (tmp_path / "b.jsonl").write_text(second)
    before = _listing(tmp_path)
    code = prepare("--input", tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--output-prefix",
                   tmp_path / "out", "--tokenizer-model", tokenizer_dir)  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], err
    assert errors[0].endswith("; nothing was written")
    assert "Traceback" not in err
    assert _listing(tmp_path) == before


def test_chat_rows_need_a_chat_template(tmp_path, capsys):
    from megatron_hybrid.testing.tokenizers import build_tokenizer

    folder = build_tokenizer(tmp_path / "tok", chat_template=None, vocab_size=300)
    write_jsonl(tmp_path / "c.jsonl", chat_rows(3))
    assert prepare("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "o",
                   "--tokenizer-model", folder, "--json-keys", "messages") == 2  # fmt: skip
    assert "c.jsonl:1: 'messages': the tokenizer" in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*"))


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, capsys):
    """A template that renders an earlier assistant turn differently once more turns follow
    (here: only the last answer is shown) gives no prefix spans: refused with the fix."""
    from megatron_hybrid.testing.tokenizers import build_tokenizer

    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or "
        "loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = build_tokenizer(tmp_path / "tok", chat_template=template, vocab_size=300)
    write_jsonl(tmp_path / "c.jsonl", chat_rows(1, turns=1) + chat_rows(1, turns=2))
    assert prepare("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "o",
                   "--tokenizer-model", folder, "--json-keys", "messages") == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "c.jsonl:2: 'messages': the chat template does not render this conversation " in err
    assert "{% generation %}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--input", "{tmp}/missing.jsonl"], "--input {tmp}/missing.jsonl is not a "
                     "file", id="missing_input"),
        pytest.param(["--output-prefix", "{tmp}/no/such/out"], "the folder {tmp}/no/such does "
                     "not exist", id="missing_output_folder"),
        pytest.param(["--tokenizer-model", "{tmp}"], "--tokenizer-model {tmp} holds no Hugging "
                     "Face tokenizer", id="not_a_tokenizer"),
        pytest.param(["--json-keys", "text", "text"], "names a key twice", id="duplicate_key"),
        pytest.param(["--workers", "0"], "--workers 0 must be >= 1", id="no_workers"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2(tmp_path, tokenizer_dir, argv, message, capsys):
    write_jsonl(tmp_path / "a.jsonl", text_rows(3))
    flags = {"--input": [str(tmp_path / "a.jsonl")], "--output-prefix": [str(tmp_path / "o")],
             "--tokenizer-model": [str(tokenizer_dir)]}  # fmt: skip
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            flags[arg] = [a.format(tmp=tmp_path) for a in argv[i + 1 :]][:1]
            if arg == "--json-keys":
                flags[arg] = argv[i + 1 :]
    assert prepare(*[x for flag, values in flags.items() for x in (flag, *values)]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and err.count("error:") == 1, err
    assert not list(tmp_path.glob("o_*"))


def test_existing_output_needs_overwrite_and_loses_its_stale_mask(tmp_path, tokenizer_dir, capsys):
    write_jsonl(tmp_path / "chat.jsonl", [{"text": r["messages"]} for r in chat_rows(3)])
    write_jsonl(tmp_path / "text.jsonl", text_rows(3))
    common = ["--output-prefix", tmp_path / "o", "--tokenizer-model", tokenizer_dir]
    assert prepare("--input", tmp_path / "chat.jsonl", *common) == 0
    assert (tmp_path / "o_text_document_loss_mask.bin").exists()
    assert prepare("--input", tmp_path / "text.jsonl", *common) == 2
    assert "already exist; pass --overwrite" in capsys.readouterr().err
    assert prepare("--input", tmp_path / "text.jsonl", *common, "--overwrite") == 0
    assert not list(tmp_path.glob("o_text_document_loss_mask*"))  # it described the old data
    assert len(read(tmp_path / "o_text_document")) == 3


def test_offsets_path_gives_the_same_masks(tokenizer_dir):
    """A tokenizer without a Rust backend is read through its offset mapping: same masks."""
    from megatron_hybrid.data.chat import ChatRenderer

    fast = tokenizer(tokenizer_dir)

    class WithoutBackend:
        def __getattr__(self, name):
            if name == "backend_tokenizer":
                raise AttributeError(name)
            return getattr(fast, name)

        def __call__(self, *args, **kwargs):
            return fast(*args, **kwargs)

    conversations = [row["messages"] for row in chat_rows(20, seed=5, turns=2)]
    direct = ChatRenderer(fast).encode(conversations)
    through_offsets = ChatRenderer(WithoutBackend()).encode(conversations)
    for (ids, mask), (ids2, mask2) in zip(direct, through_offsets, strict=True):
        assert ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist()
        assert 0 < mask.sum() < len(mask)

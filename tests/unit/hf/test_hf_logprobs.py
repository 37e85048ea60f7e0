"""``forward_logprobs`` on every Hugging Face family against transformers, at TP1, TP2 and EP2.

Sequences of lengths 1, 5, 17, 30 and 9 are scored packed (THD, several micro-batches) by a
model from ``load_hf_model``; the reference is ``log_softmax`` of transformers' float32 logits of
each sequence run alone (max abs within twice the family's logits bound, at least 1e-3),
entropies too. The
``logprobs`` command is checked on one family through its real entry point.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import hf_oracle
import pytest
import torch
from hf_oracle import CONVERTED
from support.packing import PACKING_LENGTHS, random_sequences

from megatron_hybrid.testing.spawn import run_distributed

BOUND = 1e-3


def _bound(hf_folders, family) -> float:
    """``BOUND``, or twice the family's logits bound where larger: a log-probability is a logit
    minus their log-sum-exp, so it errs by at most twice the largest logit error (entropies
    are held to the same number)."""
    return max(BOUND, 2 * hf_folders[family][2])


VOCAB = 256  # the tiny checkpoints' vocabulary


@pytest.fixture(scope="module")
def sequences():
    return random_sequences(PACKING_LENGTHS, vocab_size=VOCAB, seed=11)


@pytest.fixture(scope="module")
def references(hf_folders, sequences):
    """family -> per sequence ``(logprobs, entropies)`` of transformers, float64."""
    out = {}
    for family in CONVERTED:
        folder = hf_folders[family][0]
        pairs = []
        for s in sequences:
            log_p = torch.log_softmax(hf_oracle.hf_logits(folder, s.unsqueeze(0))[0].double(), -1)
            log_p = log_p[:-1]
            pairs.append(
                (log_p.gather(-1, s[1:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1))
            )
        out[family] = pairs
    return out


def _error(got, want) -> float:
    diffs = [
        (torch.as_tensor(a).double() - b).abs().max().item()
        for pair_got, pair_want in zip(got, want, strict=True)
        for a, b in zip(pair_got, pair_want, strict=True)
        if b.numel()
    ]
    assert [len(a[0]) for a in got] == [len(b[0]) for b in want]
    return max(diffs)


@pytest.mark.parametrize("family", CONVERTED)
def test_logprobs_match_transformers(family, hf_folders, sequences, references, pg):
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.logprobs import forward_logprobs

    model = load_hf_model(hf_folders[family][0])
    # 32 tokens per micro-batch: the 30-token sequence alone, the others packed together.
    got = list(zip(*forward_logprobs(model, sequences, max_tokens_per_micro_batch=32,
                                     with_entropy=True, packed=True), strict=True))  # fmt: skip
    assert _error(got, references[family]) <= _bound(hf_folders, family)


def _layouts_worker(rank, world_size, folders, sequences, layouts):
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.logprobs import forward_logprobs
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    torch.set_num_threads(1)
    out = {}
    for layout, kwargs in layouts.items():
        for family, folder in folders.items():
            if layout == "ep2" and family == "qwen3_5":
                continue  # no experts to place
            reset_megatron_state()
            model = load_hf_model(folder, **kwargs)
            lp, h = forward_logprobs(model, sequences, max_tokens_per_micro_batch=64,
                                     with_entropy=True, packed=True)  # fmt: skip
            got = list(zip(lp, h, strict=True))
            out[layout, family] = [[p.tolist() for p in pair] for pair in got]
    reset_megatron_state()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_and_ep2_match_transformers(hf_folders, sequences, references):
    folders = {family: hf_folders[family][0] for family in CONVERTED}
    layouts = {
        "tp2": dict(tensor_model_parallel_size=2),
        "ep2": dict(expert_model_parallel_size=2),
    }
    per_rank = run_distributed(_layouts_worker, 2, folders, sequences, layouts, timeout=900)
    for rank, results in enumerate(per_rank):
        assert len(results) == 2 * len(CONVERTED) - 1
        for (layout, family), got in results.items():
            bound = _bound(hf_folders, family)
            assert _error(got, references[family]) <= bound, (layout, family, rank)


def test_logprobs_command_writes_transformers_numbers(hf_folders, sequences, references, tmp_path):
    family = "qwen3_next"
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in sequences))
    target = tmp_path / "out.jsonl"
    argv = ["logprobs", "--load-hf", str(hf_folders[family][0]), "--input", str(source),
            "--output", str(target), "--entropy", "--max-tokens-per-micro-batch", "40"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "megatron_hybrid", *argv],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {len(sequences)} sequences" in done.stdout
    records = [json.loads(line) for line in target.read_text().splitlines()]
    got = [(r["logprobs"], r["entropies"]) for r in records]
    assert _error(got, references[family]) <= _bound(hf_folders, family)


def _command_worker(rank, world_size, argv):
    from megatron_hybrid.cli.main import main

    return main(argv)


@pytest.mark.distributed
def test_logprobs_command_with_more_replicas_than_sequences(
    hf_folders, sequences, references, tmp_path
):
    """Two data-parallel replicas, one sequence: the replica without a share joins the
    collectives instead of refusing an empty list."""
    family, index = "qwen3_5", 2
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"input_ids": sequences[index].tolist()}) + "\n")
    target = tmp_path / "out.jsonl"
    argv = ["logprobs", "--load-hf", str(hf_folders[family][0]), "--input", str(source),
            "--output", str(target)]  # fmt: skip
    assert run_distributed(_command_worker, 2, argv, timeout=600) == [0, 0]
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 1
    got = torch.tensor(records[0]["logprobs"], dtype=torch.float64)
    assert (got - references[family][index][0]).abs().max().item() <= _bound(hf_folders, family)


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"input_ids": [1, 2]}', "not json"], "line 2 is not JSON"),
        (['{"tokens": [1, 2]}'], r'line 1 must be \{"input_ids"'),
        (['{"input_ids": [1, -2]}'], "token ids >= 0"),
        (['{"input_ids": []}'], "line 1 has no tokens"),
        ([""], "holds no sequences"),
        (['{"input_ids": [1, 999]}'], r"line 1 holds token id 999, outside the model's vocab"),
    ],
    ids=["json", "key", "negative", "empty-sequence", "empty-file", "id-past-vocab"],
)
def test_logprobs_command_refuses_bad_input(lines, match, hf_folders, tmp_path, capsys, pg):
    from megatron_hybrid.cli.main import main

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    argv = ["logprobs", "--load-hf", str(hf_folders["qwen3_5"][0]), "--input", str(source)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(match, err), err

"""``forward_logprobs``' check that the ranks of one model replica pass the same sequences.

Two gloo ranks stand for one replica (tensor and pipeline parallel ranks must score the same
list). The check compares a digest of every token, its position in its sequence and its
sequence's number, so a changed token, a swapped pair of sequences or a moved boundary between
two sequences (the same tokens in the same order) is found; the same list passes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed

BASE = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]

#: What rank 1 passes instead of ``BASE``; None: the same list.
CASES = {
    "same": None,
    "changed-token": [[5, 6, 7, 8], [9, 10], [11, 12, 14]],
    "swapped-sequences": [[9, 10], [5, 6, 7, 8], [11, 12, 13]],
    "moved-boundary": [[5, 6, 7], [8, 9, 10], [11, 12, 13]],
    "dropped-sequence": [[5, 6, 7, 8], [9, 10]],
}


def _worker(rank: int, world_size: int, other):
    from megatron_hybrid.logprobs.batches import replica_error

    lists = BASE if rank == 0 or other is None else other
    tokens = [torch.tensor(t) for t in lists]
    return replica_error(tokens, torch.distributed.group.WORLD, torch.device("cpu"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_replica_ranks_must_pass_the_same_sequences(case):
    errors = run_distributed(_worker, 2, CASES[case], timeout=120)
    assert errors[0] == errors[1]
    if CASES[case] is None:
        assert errors[0] is None
    else:
        assert errors[0] is not None and "passed different sequences" in errors[0]


def test_a_replica_of_one_rank_is_not_checked():
    from megatron_hybrid.logprobs.batches import replica_error

    assert replica_error([torch.tensor([1, 2])], None, torch.device("cpu")) is None

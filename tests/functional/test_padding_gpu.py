"""Padded variable-length batches under TP2 + SP + EP2 (HybridEP-style alignment, NCCL).

The padded batch of the parallel model must give, token by token, the losses of the same padded
batch on one rank, and those must equal the ones computed from the unpadded sequences one by
one: padding moves no real token and changes no real token's result.
"""

from __future__ import annotations

import pytest
import torch
from conftest import exact_float32, report

PATTERN = "[*-][*E]{2}"
LENGTHS = [37, 64, 50]
#: The output layer's scale-up: logits of O(1) spread, so each token's loss is its own.
SHARPEN = 20.0
#: Float32 with TF32 off: TP, SP and EP only reorder sums (1e-6 relative at these sizes);
#: a token that moved or saw a pad changes its loss by O(1). In bf16 the rounding differences
#: between layouts flip routing decisions, which moves single tokens by O(1) too.
FP32_BOUND = 1e-3


def _inputs(device):
    generator = torch.Generator().manual_seed(21)
    return [torch.randint(1, 128, (n + 1,), generator=generator) for n in LENGTHS]


def _padded_losses(model, sequences, plan, device):
    """Per sequence, the per-token losses at its real positions (padded batch of ``plan``),
    the padded length, and the largest logit magnitude."""
    from megatron_hybrid.padding import pad_bshd

    cur = max(len(s) - 1 for s in sequences)
    tokens = torch.zeros(len(sequences), cur + 1, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    lengths = [len(s) - 1 for s in sequences]
    real = (torch.arange(cur).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    batch = pad_bshd(
        dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:],
             position_ids=torch.arange(cur).expand(len(sequences), -1).contiguous(),
             loss_mask=real),
        plan, lengths=lengths,
    ).tensors  # fmt: skip
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = batch.pop("loss_mask").bool()
    labels = batch.pop("labels")
    with torch.no_grad(), exact_float32():
        logits = model(**batch, attention_mask=None).float()
        losses = model(**batch, labels=labels, attention_mask=None).float()
    per_sequence = [losses[i][mask[i]].cpu() for i in range(len(sequences))]
    return per_sequence, batch["input_ids"].shape[1], logits.abs().max().item()


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_padded_tp2_sp_ep2_matches_unpadded(world, shared_dir):
    """Per token: TP2 + SP + EP2 padded == TP1 padded == each sequence alone at TP1, float32
    (the output layer is scaled by 20 first, so that the losses differ from token to token by
    O(1) rather than all sitting at log(vocab)).
    Control: the losses of neighbouring tokens differ by far more than the bound, so a token
    that moved would be seen."""
    from megatron.core import dist_checkpointing

    from megatron_hybrid.padding import bshd_pad, padding_config_from
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid, small_config

    rank, world_size, device = world
    if world_size not in (2, 4):
        pytest.skip("TP2 + EP2 runs on 2 GPUs (EP over the TP ranks) or 4 GPUs (DP2)")
    sequences = _inputs(device)

    def model_for(tp, ep):
        pg = initialize_model_parallel(tp=tp, ep=ep, etp=1, seed=2)
        config = small_config(
            PATTERN, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        )  # fmt: skip
        torch.manual_seed(1)
        return build_hybrid(config, PATTERN, pg).to(device), config, pg

    single, config1, pg1 = model_for(1, 1)
    with torch.no_grad():
        single.output_layer.weight.mul_(SHARPEN)
    dist_checkpointing.save(single.sharded_state_dict(), shared_dir)
    plan1 = padding_config_from(config1, pg1).bshd(cur_len=max(LENGTHS), batch_size=len(LENGTHS))
    single_losses, _, largest = _padded_losses(single, sequences, plan1, device)
    # Unpadded: each sequence alone at its own length (TP1 needs no alignment).
    alone = []
    for s in sequences:
        plan = bshd_pad(cur_len=len(s) - 1, batch_size=1, tp=1, cp=1, sp=False)
        alone += _padded_losses(single, [s], plan, device)[0]

    parallel, config2, pg2 = model_for(2, 2)
    state = dist_checkpointing.load(parallel.sharded_state_dict(), shared_dir)
    parallel.load_state_dict(state, strict=False)
    plan2 = padding_config_from(config2, pg2).bshd(cur_len=max(LENGTHS), batch_size=len(LENGTHS))
    parallel_losses, padded_len, _ = _padded_losses(parallel, sequences, plan2, device)
    bound = FP32_BOUND
    parallel_diff = _max_diff(parallel_losses, single_losses)
    padded_diff = _max_diff(single_losses, alone)
    neighbours = torch.cat([(x[1:] - x[:-1]).abs() for x in alone]).mean().item()
    report(
        f"padded variable lengths, TP2+SP+EP2 on {world_size} GPUs, per-token losses",
        [("lengths", LENGTHS), ("padded to", f"{padded_len} (multiple {plan2.divisible_by})"),
         ("max |TP2+SP+EP2 padded - TP1 padded|", f"{parallel_diff:.3e}"),
         ("max |TP1 padded - TP1 alone|", f"{padded_diff:.3e}"),
         (f"bound (float32, largest logit {largest:.1f})", f"{bound:.3e}"),
         ("control: mean |loss of a token - loss of the next|", f"{neighbours:.3e}")],
    )  # fmt: skip
    assert padded_len % plan2.divisible_by == 0
    assert parallel_diff <= bound and padded_diff <= bound
    assert neighbours > 4 * bound, "the losses barely differ from token to token"

"""Padded variable-length batches under TP2 + SP + EP2 (HybridEP-style alignment, NCCL).

The padded batch of the parallel model must give the loss of the same padded batch on one rank,
and that loss must equal the one computed from the unpadded sequences one by one: padding moves
no real token and changes no real token's result.
"""

from __future__ import annotations

import pytest
import torch
from conftest import report

PATTERN = "[*-][*E]{2}"
LENGTHS = [37, 64, 50]


def _inputs(device):
    generator = torch.Generator().manual_seed(21)
    return [torch.randint(1, 128, (n + 1,), generator=generator) for n in LENGTHS]


def _padded_loss(model, sequences, plan, device):
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
    mask = batch.pop("loss_mask")
    with torch.no_grad():
        losses = model(**batch, attention_mask=None).float()
    return (losses * mask).sum().item() / mask.sum().item(), batch["input_ids"].shape[1]


def test_padded_tp2_sp_ep2_matches_unpadded(world, shared_dir):
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.padding import padding_config_from
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
            expert_model_parallel_size=ep, expert_tensor_parallel_size=1, bf16=True,
            params_dtype=torch.bfloat16,
        )  # fmt: skip
        torch.manual_seed(1)
        return Float16Module(config, build_hybrid(config, PATTERN, pg).to(device)), config, pg

    single, config1, pg1 = model_for(1, 1)
    dist_checkpointing.save(single.sharded_state_dict(), shared_dir)
    plan1 = padding_config_from(config1, pg1).bshd(cur_len=max(LENGTHS), batch_size=len(LENGTHS))
    single_loss, _ = _padded_loss(single, sequences, plan1, device)
    # Unpadded: each sequence alone at its own length (TP1 needs no alignment).
    total, count = 0.0, 0
    from megatron_hybrid.padding import bshd_pad

    for s in sequences:
        plan = bshd_pad(cur_len=len(s) - 1, batch_size=1, tp=1, cp=1, sp=False)
        loss, _ = _padded_loss(single, [s], plan, device)
        total, count = total + loss * (len(s) - 1), count + len(s) - 1
    unpadded_loss = total / count

    parallel, config2, pg2 = model_for(2, 2)
    state = dist_checkpointing.load(parallel.sharded_state_dict(), shared_dir)
    parallel.module.load_state_dict(state, strict=False)
    plan2 = padding_config_from(config2, pg2).bshd(cur_len=max(LENGTHS), batch_size=len(LENGTHS))
    parallel_loss, padded_len = _padded_loss(parallel, sequences, plan2, device)
    report(
        f"padded variable lengths, TP2+SP+EP2 on {world_size} GPUs",
        [("lengths", LENGTHS), ("padded to", f"{padded_len} (multiple {plan2.divisible_by})"),
         ("TP2+SP+EP2 padded", f"{parallel_loss:.6f}"), ("TP1 padded", f"{single_loss:.6f}"),
         ("TP1 unpadded, one by one", f"{unpadded_loss:.6f}")],
    )  # fmt: skip
    assert padded_len % plan2.divisible_by == 0
    assert parallel_loss == pytest.approx(single_loss, rel=2e-2)
    assert single_loss == pytest.approx(unpadded_loss, rel=2e-2)

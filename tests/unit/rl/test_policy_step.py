"""``PolicyTrainer.step`` against transformers: one ``sgd`` step moves every weight by ``-lr``
times the gradient of the same loss computed by transformers in float32.

Dense, MoE and GatedDeltaNet families (``rl_oracle.FAMILIES``), every ``loss_agg`` with and
without the old/reference log-probs, KL and entropy terms, at TP1 (this process) and on two gloo
ranks at TP2 and EP2 (the MoE family) or DP2 (the others, which have no experts to place), and
through megatron-core's pipeline schedules at PP2 (MoE) and PP2 x VPP2 (the four-layer dense
model, interleaved). EP2 is data parallelism 2 as well: at EP2 and DP2 each rank steps on its
half of the global batch, so the token and sequence counts are reduced over data-parallel
ranks. The two-rank run also
checks ``sample``'s greedy tokens at TP2 and EP2 against transformers' ``generate``. The batch
makes four micro-batches of different loss-masked token counts and holds a sequence without
loss-masked tokens. Negative controls: a loss averaged per micro-batch instead of over the
global batch, and log-probs of the wrong token shift, each miss the bound by far.
"""

from __future__ import annotations

import pytest
import rl_oracle
import torch
from rl_oracle import (
    LR,
    NEW_TOKENS,
    VARIANTS,
    assert_greedy_matches,
    bound,
    transformers_greedy,
    worst_error,
)

from megatron_hybrid.testing.spawn import run_distributed


def step_deltas(folder, layout: dict, batch, variants, deltas: bool = True, greedy=None):
    """Per variant: ``(metrics, {name: (w_before - w_after) / lr})`` of one sgd step from the
    same weights, and the weights before (``deltas=False``: metrics only); with ``greedy`` a
    list that receives ``sample``'s greedy tokens of the prompts first."""
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.hf.weights import model_chunks
    from megatron_hybrid.rl import PolicyTrainer, sample

    model = load_hf_model(folder, **layout)
    if greedy is not None:
        generated = sample(model, rl_oracle.prompts(), max_new_tokens=NEW_TOKENS, temperature=0,
                           seed=0)  # fmt: skip
        greedy.extend(t.tolist() for t in generated)
    trainer = PolicyTrainer(model, optimizer="sgd", lr=LR, clip_grad=0.0)
    params = [p for chunk in model_chunks(model) for p in chunk.parameters()]
    start = [p.detach().clone() for p in params]
    before = {n: t.detach().double().clone() for n, t in trainer.iter_hf_weights()}
    dp, dp_rank = trainer.pg.dp.size(), trainer.pg.dp.rank()
    mine = list(range(dp_rank, len(batch.sequences), dp))
    out = {}
    for variant in variants:
        with torch.no_grad():
            for param, value in zip(params, start, strict=True):
                param.copy_(value)
        metrics = trainer.step(
            [batch.sequences[i] for i in mine], **variant.step_kwargs(batch, mine)
        )
        after = {n: t.detach().double() for n, t in trainer.iter_hf_weights()}
        moved = {n: ((before[n] - after[n]) / LR).numpy() for n in before} if deltas else {}
        out[variant.name] = (metrics.as_dict(), moved)
    return out, ({n: w.numpy() for n, w in before.items()} if deltas else {})


def _check(results, weights, case, where):
    batch, oracle = case
    for name, (metrics, deltas) in results.items():
        loss, grads = oracle[name]
        weights_t = {n: torch.as_tensor(w) for n, w in weights.items()}
        limit = bound(grads, weights_t)
        error = worst_error(deltas, grads)
        assert error <= limit, (where, name, error, limit)
        assert metrics["skipped"] is None
        assert abs(metrics["loss"] - loss) <= 1e-5 * max(1.0, abs(loss)), (where, name)
        assert metrics["tokens"] == sum(rl_oracle.LENGTHS)
        assert metrics["loss_tokens"] == int(sum(m.sum() for m in batch.loss_masks))


@pytest.mark.parametrize("family", list(rl_oracle.FAMILIES))
def test_one_sgd_step_is_minus_lr_times_transformers_gradient(pg, family, rl_folders, rl_cases):
    results, weights = step_deltas(rl_folders[family], {}, rl_cases[family][0], VARIANTS)
    _check(results, weights, rl_cases[family], f"{family} TP1")


#: Two-rank layouts: name -> (load_hf_model keywords, families).
LAYOUTS = {
    "tp2": (dict(tensor_model_parallel_size=2), ("dense", "moe", "gdn")),
    "ep2": (dict(expert_model_parallel_size=2), ("moe",)),
    "dp2": ({}, ("dense", "gdn")),
    "pp2": (dict(pipeline_model_parallel_size=2), ("moe",)),
    "pp2-vpp2": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ("dense",),
    ),
}


def _layouts_worker(rank, world_size, folders, batches):
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    torch.set_num_threads(1)
    out = {}
    for layout, (kwargs, families) in LAYOUTS.items():
        for family in families:
            folder = folders[family]
            reset_megatron_state()
            greedy = [] if layout in ("tp2", "ep2") else None  # sample runs without PP
            results = step_deltas(
                folder, kwargs, batches[family], VARIANTS, deltas=rank == 0, greedy=greedy
            )
            out[layout, family] = (*results, greedy)
    reset_megatron_state()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_two_rank_layouts_step_as_transformers(rl_folders, rl_cases):
    batches = {family: rl_cases[family][0] for family in rl_oracle.FAMILIES}
    per_rank = run_distributed(_layouts_worker, 2, dict(rl_folders), batches, timeout=1200)
    assert len(per_rank[0]) == sum(len(families) for _, families in LAYOUTS.values())
    for (layout, family), (results, weights, greedy) in per_rank[0].items():
        where = f"{family} {layout}"
        _check(results, weights, rl_cases[family], where)
        if greedy is not None:  # sample's greedy tokens at TP2 / EP2
            want = transformers_greedy(rl_folders[family], rl_oracle.FAMILIES[family][0])
            assert_greedy_matches([torch.tensor(t) for t in greedy], want, where)
    for key, (results, _, greedy) in per_rank[1].items():  # every rank reports the same
        assert greedy == per_rank[0][key][2], key
        for name, (metrics, _) in results.items():
            assert metrics == per_rank[0][key][0][name][0], (key, name)


def _mean_per_micro_batch(original):
    """The bug: each micro-batch's own token mean, averaged over micro-batches."""

    def loss(batch, output, **kwargs):
        total, count, report = original(batch, output, **kwargs)
        return total / count.clamp(min=1), torch.ones_like(count), report

    return loss


def _labels_of_the_current_token(original):
    """The bug: each row's label is its own input token instead of the next one."""

    def plan(*args, **kwargs):
        batches = original(*args, **kwargs)
        for batch in batches:
            batch.inputs["labels"] = batch.inputs["input_ids"].clone()
        return batches

    return plan


@pytest.mark.parametrize(
    "target, bug",
    [
        ("micro_batch_loss", _mean_per_micro_batch),
        ("plan_micro_batches", _labels_of_the_current_token),
    ],
    ids=["loss-per-micro-batch", "wrong-token-shift"],
)
def test_negative_controls_miss_the_bound(pg, monkeypatch, rl_folders, rl_cases, target, bug):
    import megatron_hybrid.rl.trainer as trainer_module

    monkeypatch.setattr(trainer_module, target, bug(getattr(trainer_module, target)))
    family, variant = "moe", VARIANTS[0]  # token-mean
    results, weights = step_deltas(rl_folders[family], {}, rl_cases[family][0], [variant])
    loss, grads = rl_cases[family][1][variant.name]
    error = worst_error(results[variant.name][1], grads)
    limit = bound(grads, {n: torch.as_tensor(w) for n, w in weights.items()})
    assert error > 100 * limit, (error, limit)

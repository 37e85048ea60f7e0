"""GPT <-> grouped checkpoints across TP/EP/PP/VPP layouts, and equal training.

bf16 models (``Float16Module``), NCCL. Each test builds its models from megatron's global
parallel state, which ``initialize_model_parallel`` resets per layout.
"""

from __future__ import annotations

import pytest
import torch
from conftest import bf16_config as _config
from conftest import device_inputs, layout_fits, report


def _chunks(builder, config, pattern, pg, device, vpp=None):
    from megatron.core.transformer.module import Float16Module

    out = []
    for vp in [None] if vpp is None else range(vpp):
        torch.manual_seed(1)
        model = builder(config, pattern, pg, vp_stage=vp).to(device)
        out.append(Float16Module(config, model))
    return out


def _sharded(chunks):
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _save(chunks, directory):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_sharded(chunks), directory)


def _load(chunks, directory):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded(chunks), directory)
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        # Float16Module.load_state_dict returns nothing; load into the model it wraps.
        missing, unexpected = chunk.module.load_state_dict(state[key], strict=False)
        assert not unexpected, unexpected
        assert all(k.endswith("_extra_state") for k in missing), missing


def _loss(chunks, device, seq=64, batch=2):
    """Mean token loss of a fixed batch (single-stage models only)."""

    inputs = device_inputs(device, batch=batch, seq=seq, seed=3)
    with torch.no_grad():
        return chunks[0](**inputs).float().mean().item()


def test_gpt_tp1_checkpoint_loads_into_grouped_tp2_and_ep2(world, shared_dir):
    from support.checkpoints import assemble_global_tensors, local_shard_mismatches

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid

    rank, world_size, device = world
    layouts = (
        ("grouped TP2+SP", dict(tp=2)),
        ("grouped EP2", dict(ep=2)),
        ("grouped TP2+SP x EP2", dict(tp=2, ep=2, etp=1)),
        ("grouped EP4", dict(ep=4)),
    )
    runnable = [(name, layout) for name, layout in layouts if layout_fits(world_size, **layout)]
    if not runnable:
        pytest.skip(f"every layout needs 2 or 4 GPUs; this job has {world_size}")
    pattern = "[*-][*E]{3}"
    gpt = _chunks(build_gpt_twin, _config(pattern), pattern, initialize_model_parallel(), device)
    reference_loss = _loss(gpt, device)
    _save(gpt, shared_dir)
    reference = assemble_global_tensors(_sharded(gpt))
    rows = [("layout", "mismatched shards", "loss", "GPT TP1 loss")]
    for name, layout in runnable:
        pg = initialize_model_parallel(**layout)
        config = _config(
            pattern,
            tensor_model_parallel_size=layout.get("tp", 1),
            sequence_parallel=layout.get("tp", 1) > 1,
            expert_model_parallel_size=layout.get("ep", 1),
            expert_tensor_parallel_size=layout.get("etp", layout.get("tp", 1)),
        )
        grouped = _chunks(build_hybrid, config, pattern, pg, device)
        _load(grouped, shared_dir)
        mismatched = local_shard_mismatches(_sharded(grouped), reference)
        loss = _loss(grouped, device)
        rows.append((name, len(mismatched), f"{loss:.6f}", f"{reference_loss:.6f}"))
        assert mismatched == []
        # bf16: TP/EP change only the reduction order.
        assert loss == pytest.approx(reference_loss, rel=2e-2)
    rows += [(name, "skipped: needs more GPUs", "", "") for name, layout in layouts
             if (name, layout) not in runnable]  # fmt: skip
    report(f"GPT TP1 checkpoint -> grouped, {world_size} GPUs", rows)


def test_grouped_pp2_vpp2_checkpoint_loads_into_gpt_tp2(world, shared_dir):
    from support.checkpoints import assemble_global_tensors, local_shard_mismatches

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid

    rank, world_size, device = world
    if world_size % 2:
        pytest.skip("needs an even number of GPUs")
    piped, flat = "[*-]|[*E]|[*E]|[*-]", "[*-][*E][*E][*-]"
    pg = initialize_model_parallel(pp=2, vpp=2)
    config = _config(piped, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    _save(_chunks(build_hybrid, config, piped, pg, device, vpp=2), shared_dir)

    unsplit = _chunks(build_hybrid, _config(flat), flat, initialize_model_parallel(), device)
    _load(unsplit, shared_dir)
    reference = assemble_global_tensors(_sharded(unsplit))
    reference_loss = _loss(unsplit, device)

    pg = initialize_model_parallel(tp=2)
    gpt = _chunks(
        build_gpt_twin, _config(flat, tensor_model_parallel_size=2, sequence_parallel=True),
        flat, pg, device,
    )  # fmt: skip
    _load(gpt, shared_dir)
    mismatched = local_shard_mismatches(_sharded(gpt), reference)
    loss = _loss(gpt, device)
    report(
        "grouped PP2xVPP2 checkpoint -> GPT TP2+SP",
        [("mismatched shards", len(mismatched)), ("GPT TP2 loss", f"{loss:.6f}"),
         ("grouped PP1 loss", f"{reference_loss:.6f}")],
    )  # fmt: skip
    assert mismatched == []
    assert loss == pytest.approx(reference_loss, rel=2e-2)


def test_gpt_and_grouped_train_the_same_from_one_checkpoint(world, shared_dir):
    """10 optimizer steps (megatron DDP + distributed optimizer) from the same checkpoint."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_hybrid.data.synthetic import SyntheticTokens
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid
    from megatron_hybrid.training.loop import train_step
    from megatron_hybrid.training.optimizers import build_optimizer

    rank, world_size, device = world
    pattern = "[*E]{4}"
    steps, seq, mbs = 10, 64, 2

    # Learnable data (a sparse Markov chain), so the loss visibly falls within 10 steps.
    data = SyntheticTokens(vocab_size=128, max_length=seq, min_length=seq, seed=3)

    def batches(step):
        out = []
        for m in range(2):
            first = ((step * world_size + rank) * 2 + m) * mbs
            tokens = torch.stack([data.sequence(first + b) for b in range(mbs)]).to(device)
            out.append(dict(
                input_ids=tokens[:, :-1], labels=tokens[:, 1:],
                position_ids=torch.arange(seq, device=device).expand(mbs, -1),
                loss_mask=torch.ones(mbs, seq, device=device), attention_mask=None,
                num_tokens=mbs * seq,
            ))  # fmt: skip
        return out

    losses = {}
    for name, builder in (("gpt", build_gpt_twin), ("grouped", build_hybrid)):
        pg = initialize_model_parallel(seed=9)
        config = _config(pattern)
        chunks = _chunks(builder, config, pattern, pg, device)
        if name == "gpt":
            _save(chunks, shared_dir)
        else:
            _load(chunks, shared_dir)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=device.type == "cuda"
        )
        chunks = [DistributedDataParallel(c.config, ddp, c, pg_collection=pg) for c in chunks]
        optimizer = build_optimizer(chunks, chunks[0].config, lr=3e-3, weight_decay=0.0,
                                    clip_grad=1.0, pg=pg)  # fmt: skip
        losses[name] = [
            train_step(chunks, optimizer, batches(s), chunks[0].config, seq_length=seq,
                       micro_batch_size=mbs, pg_collection=pg).loss
            for s in range(steps)
        ]  # fmt: skip
    diffs = [abs(a - b) for a, b in zip(losses["gpt"], losses["grouped"], strict=True)]
    report(
        "10 steps from one checkpoint (per-step loss)",
        [("step", "GPTModel", "grouped", "|diff|")]
        + [(i, f"{a:.6f}", f"{b:.6f}", f"{d:.2e}") for i, (a, b, d) in
           enumerate(zip(losses["gpt"], losses["grouped"], diffs, strict=True))],
    )  # fmt: skip
    assert losses["gpt"][-1] < losses["gpt"][0]
    assert max(diffs) <= 1e-3 * max(abs(x) for x in losses["gpt"])

"""train's fused optimizer step against megatron's own ``optimizer.step()`` on a GPU.

    torchrun --nproc_per_node 1 -m pytest -q -s tests/functional/test_fused_step_gpu.py

Two copies of a bf16 ``[*E]{2}`` model in megatron's DistributedDataParallel, each with
megatron-core's distributed optimizer (float32 main-parameter shards): one steps with
``training.optimizer_step`` (torch's fused AdamW, the ``_foreach_norm`` gradient norm, the clip
on the device), the other with megatron's ``optimizer.step()`` (torch's foreach AdamW, one
``torch.norm`` and host copy per gradient, the clip by a host factor). Both get the same
gradients (the first copy's, copied into the second's ``main_grad`` before each step) for six
steps with hyper-parameters exact in float32 (``support.adamw_reference.EXACT``), and both must
stay within the float32 rounding bound of the float64 AdamW on the same gradients, parameter by
parameter; their gradient norms agree to the float32 sum's bound. In the ``token-factor-deferred``
case the fused copy's gradients stay unscaled (as ``train_step`` leaves them) and the token
count's factor reaches the fused kernel as its ``grad_scale``, while megatron's copy gets the
gradients scaled first; the bound adds the factor's roundings. A seventh step with a NaN
planted in one gradient must change no main parameter, moment or step count of the fused copy.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import one_process_groups

STEPS = 6


@pytest.fixture
def pg(world):
    yield from one_process_groups(
        world, "megatron's distributed optimizer needs CUDA",
        "one process: the float64 oracle follows one rank's (whole) shards",
    )  # fmt: skip


def _chunks(pg):
    """The config and two copies of the model chunks with the same weights."""
    from megatron.core.utils import unwrap_model

    from megatron_hybrid.pattern import parse_pattern
    from megatron_hybrid.training.config import config_from_flags
    from megatron_hybrid.training.loop import build_model_chunks

    flags = ("--hidden-size", "128", "--num-attention-heads", "4", "--swiglu", "--bf16",
             "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "64", "--vocab-size", "128")  # fmt: skip
    config = config_from_flags("[*E]{2}", *flags)
    pattern = parse_pattern("[*E]{2}")
    kwargs = dict(backend="local", vocab_size=128, max_sequence_length=64)
    chunks = [build_model_chunks(config, pattern, pg, **kwargs) for _ in range(2)]
    unwrap_model(chunks[1])[0].load_state_dict(unwrap_model(chunks[0])[0].state_dict())
    return config, chunks


def _setup(pg):
    from support.adamw_reference import EXACT

    from megatron_hybrid.training.optimizers import build_optimizer

    config, chunks = _chunks(pg)
    args = dict(lr=EXACT.lr, weight_decay=EXACT.weight_decay, clip_grad=EXACT.clip, pg=pg)
    fused = build_optimizer(chunks[0], config, **args)
    megatron = build_optimizer(chunks[1], config, fused=False, **args)  # megatron's AdamW
    for optimizer in (fused, megatron):
        for group in optimizer.param_groups:
            group.update(betas=EXACT.betas, eps=EXACT.eps)
    return config, chunks, fused, megatron


def _main_params(optimizer) -> list[torch.Tensor]:
    from megatron_hybrid.training.optimizer_step import _torch_optimizers

    return [p for inner in _torch_optimizers(optimizer) for g in inner.param_groups
            for p in g["params"]]  # fmt: skip


def _backward(chunks, config, pg, seed: int) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hybrid.schedule.steps import lm_forward_step
    from megatron_hybrid.training.loop import _configure_hooks

    _configure_hooks(chunks, config, pg)
    chunks[0].zero_grad_buffer()
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        tokens = torch.randint(1, 128, (2, 65), generator=generator).cuda()
        batches.append(dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:],
                            position_ids=torch.arange(64).cuda().expand(2, -1),
                            loss_mask=torch.ones(2, 64).cuda(), attention_mask=None))  # fmt: skip
    get_forward_backward_func()(
        forward_step_func=lm_forward_step, data_iterator=iter(batches), model=chunks[0],
        num_microbatches=2, seq_length=64, micro_batch_size=2, forward_only=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "deferred",
    [pytest.param(False, id="scaled-first"), pytest.param(True, id="token-factor-deferred")],
)
def test_fused_step_and_megatrons_step_stay_within_the_float64_bound(pg, deferred):
    from support.adamw_reference import (
        DEFERRED_ROUNDINGS,
        EXACT,
        adamw_float64,
        gamma,
        rounding_bound,
    )

    from megatron_hybrid.training.loop import deferred_gradient_scaling, take_deferred_scaling
    from megatron_hybrid.training.optimizer_step import apply_step, guard_statistics

    config, chunks, fused, megatron = _setup(pg)
    initial = [p.detach().double().clone() for p in _main_params(fused)]
    grads_by_step, fused_norms, megatron_norms = [], [], []
    for step in range(STEPS):
        with deferred_gradient_scaling(chunks[0], deferred) as factors:
            _backward(chunks[0], config, pg, seed=step)
        scaling = take_deferred_scaling(chunks[0], factors)
        assert (scaling is not None) == deferred
        for a, b in zip(chunks[0][0].parameters(), chunks[1][0].parameters(), strict=True):
            b.main_grad.copy_(a.main_grad if scaling is None else a.main_grad * scaling)
        for optimizer in (fused, megatron):
            optimizer.zero_grad()
        zeros = torch.zeros(2, dtype=torch.float64, device="cuda")
        stats = guard_statistics(fused, zeros, scaling)
        factor = 1.0 if scaling is None else float(scaling)
        grads_by_step.append([p.grad.detach().double() * factor for p in _main_params(fused)])
        apply_step(fused, stats, EXACT.clip)
        fused_norms.append(float(stats.grad_norm))
        megatron_norms.append(float(megatron.step()[1]))
    exact, trajectory = adamw_float64(initial, grads_by_step, EXACT)
    elements = sum(p.numel() for p in initial)
    rows = []
    for name, optimizer in (("fused", fused), ("megatron", megatron)):
        extra = DEFERRED_ROUNDINGS if deferred and name == "fused" else 0
        # megatron's copy got float32 products g * s: one rounding more than the oracle's.
        extra += 1 if deferred and name == "megatron" else 0
        bounds = rounding_bound(trajectory, elements, EXACT, extra)
        params = _main_params(optimizer)
        ratios = [float(((p.double() - e).abs() / b).max())
                  for p, e, b in zip(params, exact, bounds, strict=True)]  # fmt: skip
        rows.append((name, max(ratios)))
        assert max(ratios) <= 1.0, (name, ratios)
    print(f"\nworst error / bound: {rows}; norms fused {fused_norms} megatron {megatron_norms}")
    for a, b in zip(fused_norms, megatron_norms, strict=True):
        assert a == pytest.approx(b, rel=2 * gamma(elements))
    assert all(math.isfinite(n) for n in fused_norms)

    # A NaN gradient: the fused kernel skips on the device; nothing the optimizer keeps changes.
    _backward(chunks[0], config, pg, seed=STEPS)
    next(iter(chunks[0][0].parameters())).main_grad.view(-1)[0] = float("nan")
    fused.zero_grad()
    before = [p.detach().clone() for p in _main_params(fused)]
    from megatron_hybrid.training.optimizer_step import _torch_optimizers

    states = [{k: v.clone() for k, v in inner.state[p].items()}
              for inner in _torch_optimizers(fused) for g in inner.param_groups
              for p in g["params"]]  # fmt: skip
    stats = guard_statistics(fused, torch.zeros(2, dtype=torch.float64, device="cuda"))
    apply_step(fused, stats, EXACT.clip)
    assert bool(stats.nonfinite)
    after = [inner.state[p] for inner in _torch_optimizers(fused) for g in inner.param_groups
             for p in g["params"]]  # fmt: skip
    for p, old, state, saved in zip(_main_params(fused), before, after, states, strict=True):
        assert torch.equal(p, old)
        assert all(torch.equal(state[k], v) for k, v in saved.items())


def test_gradient_scaling_in_one_pass_is_megatrons_bit_for_bit(pg):
    """``finalize_model_grads``' division by the token count, a 0-d CUDA tensor, through
    ``TrainDistributedDataParallel.scale_gradients`` (one multi-tensor kernel over every buffer
    and extra main grad) gives each float32 gradient megatron's own per-buffer result bit for
    bit. Control: a factor one float32 step away changes them."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_hybrid.training.loop import TrainDistributedDataParallel

    chunk = _setup(pg)[1][0][0]
    assert isinstance(chunk, TrainDistributedDataParallel)
    buffers = chunk.buffers + chunk.expert_parallel_buffers
    gen = torch.Generator(device="cuda").manual_seed(5)
    buffers[0].extra_main_grads.append(torch.empty(1000, device="cuda"))
    grads = [g for b in buffers for g in (b.grad_data, *b.extra_main_grads)]
    values = [
        torch.randn(g.shape, device="cuda", generator=gen)
        * 10 ** torch.randn(g.shape, device="cuda", generator=gen)
        for g in grads
    ]
    factor = torch.tensor(1.0, device="cuda") / torch.tensor(40_961, device="cuda").clamp(min=1)

    def scaled(scale, value):
        for grad, start in zip(grads, values, strict=True):
            grad.copy_(start)
        scale(value)
        return [g.clone() for g in grads]

    try:
        ours = scaled(chunk.scale_gradients, factor)
        megatron = scaled(lambda f: DistributedDataParallel.scale_gradients(chunk, f), factor)
        nudged = scaled(chunk.scale_gradients, torch.nextafter(factor, factor.new_tensor(1.0)))
    finally:
        buffers[0].extra_main_grads.pop()
    assert factor.dtype == torch.float32 and factor.is_cuda and factor.dim() == 0
    assert all(torch.equal(a, b) for a, b in zip(ours, megatron, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(nudged, megatron, strict=True))


def test_cached_shard_copies_are_megatrons_bit_for_bit(pg, monkeypatch):
    """The distributed optimizer's copies between model and main parameters over views taken
    once (``training/shard_copies.py``, opt-in); the same fused optimizer with megatron's two
    methods gives the same model and main parameters bit for bit over three steps on the same
    gradients. Controls: the cached copies were installed on one only (the opt-in switch unset
    here, whatever the runner's environment), and the steps moved the parameters."""
    from support.adamw_reference import EXACT

    from megatron_hybrid.training.optimizer_step import apply_step, guard_statistics
    from megatron_hybrid.training.optimizers import build_optimizer
    from megatron_hybrid.training.shard_copies import cache_shard_copies

    monkeypatch.delenv("MEGATRON_HYBRID_CACHED_SHARD_COPIES", raising=False)
    config, chunks = _chunks(pg)
    args = dict(lr=EXACT.lr, weight_decay=EXACT.weight_decay, clip_grad=EXACT.clip, pg=pg)
    cached, plain = (build_optimizer(c, config, **args) for c in chunks)
    assert cache_shard_copies(cached) is None  # off by default (MEGATRON_HYBRID_CACHED_...)
    for optimizer, installed in ((cached, True), (plain, False)):
        for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            assert ("_copy_main_params_to_model_params" in vars(sub)) == installed
    before = [p.detach().clone() for p in chunks[0][0].parameters()]
    for step in range(3):
        _backward(chunks[0], config, pg, seed=step)
        for a, b in zip(chunks[0][0].parameters(), chunks[1][0].parameters(), strict=True):
            b.main_grad.copy_(a.main_grad)
        for optimizer in (cached, plain):
            optimizer.zero_grad()
            stats = guard_statistics(optimizer, torch.zeros(2, dtype=torch.float64, device="cuda"))
            apply_step(optimizer, stats, EXACT.clip)
    pairs = list(zip(chunks[0][0].parameters(), chunks[1][0].parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(torch.equal(a, b) for a, b in zip(_main_params(cached), _main_params(plain),
                                                  strict=True))  # fmt: skip
    moved = sum(not torch.equal(a, p) for a, (p, _) in zip(before, pairs, strict=True))
    print(f"\n{len(pairs)} parameters bitwise equal, {moved} moved by the steps")
    assert moved > len(pairs) // 2

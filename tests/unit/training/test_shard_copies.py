"""The distributed optimizer's two copies over cached views (``training/shard_copies.py``) against
megatron-core's own methods, run on the same stand-in optimizer: one that holds what those
methods read (megatron's ``DistributedOptimizer`` needs CUDA to be built; the real one runs in
``tests/functional/test_fused_step_gpu.py``). The stand-in is rank 1 of two data-parallel
ranks: its shards start inside one parameter and end inside another, as real shards do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

from megatron_hybrid.training.shard_copies import ShardViews, cache_shard_copies


class StandIn(DistributedOptimizer):
    """Two bfloat16 parameters in one bucket (40 elements, this rank's half from element 20),
    one float32 parameter in a bucket of its own (12 elements, this rank's half from 6)."""

    def __init__(self, seed: int = 0):  # megatron's constructor needs CUDA: not called
        generator = torch.Generator().manual_seed(seed)

        def param(*shape, dtype=torch.bfloat16):
            p = torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
            p.main_grad = torch.randn(shape, generator=generator)
            return p

        def shard(n):
            return torch.nn.Parameter(torch.randn(n, generator=generator))

        self.p0, self.p1, self.p2 = param(6, 5), param(7), param(3, 4, dtype=torch.float32)
        self.is_stub_optimizer = False
        self.ddp_config = SimpleNamespace(
            use_megatron_fsdp=False, fp8_param_gather=False, fp4_param_gather=False
        )
        self.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
        self.model_float16_groups = [[self.p0, self.p1]]
        self.shard_fp32_from_float16_groups = [[shard(10), shard(7)]]
        self.model_fp32_groups = [[self.p2]]
        self.shard_fp32_groups = [[shard(6)]]
        self.model_param_gbuf_map = {
            self.p0: (0, torch.bfloat16, 0),
            self.p1: (0, torch.bfloat16, 0),
            self.p2: (1, torch.float32, 0),
        }
        ranges = {  # (the shard's range in the parameter, in the bucket's world buffer)
            self.p0: (Range(20, 30), Range(20, 30)),
            self.p1: (Range(0, 7), Range(30, 37)),
            self.p2: (Range(6, 12), Range(6, 12)),
        }
        self.gbuf_ranges = [
            {torch.bfloat16: [{"param_map": {}}]},
            {torch.float32: [{"param_map": {}}]},
        ]
        for p, (in_param, in_world) in ranges.items():
            gbuf, dtype, bucket = self.model_param_gbuf_map[p]
            self.gbuf_ranges[gbuf][dtype][bucket]["param_map"][p] = {
                "param": in_param, "gbuf_world_in_bucket": in_world
            }  # fmt: skip
        self.buffers = [
            SimpleNamespace(buckets=[SimpleNamespace(param_data=torch.zeros(40, dtype=p.dtype))])
            for p in (self.p0, self.p2)
        ]

    def shards(self) -> list[torch.Tensor]:
        return [*self.shard_fp32_from_float16_groups[0], *self.shard_fp32_groups[0]]

    def param_data(self) -> list[torch.Tensor]:
        return [bucket.param_data for b in self.buffers for bucket in b.buckets]


def _result(optimizer: StandIn):
    """Each shard's ``.grad`` (its values, and where it lies: which parameter's ``main_grad``
    and at what offset) and the parameter buffers."""
    owners = [optimizer.p0, optimizer.p1, optimizer.p2]
    grads = []
    for shard, owner in zip(optimizer.shards(), owners, strict=True):
        if shard.grad is None:
            grads.append((None, None, False))
            continue
        same_storage = shard.grad.untyped_storage().data_ptr() == (
            owner.main_grad.untyped_storage().data_ptr()
        )
        grads.append((shard.grad.clone(), shard.grad.storage_offset(), same_storage))
    return grads, [d.clone() for d in optimizer.param_data()]


def _megatron(optimizer: StandIn):
    DistributedOptimizer._copy_model_grads_to_main_grads(optimizer)
    DistributedOptimizer._copy_main_params_to_model_params(optimizer)
    return _result(optimizer)


def _ours(optimizer: StandIn):
    optimizer._copy_model_grads_to_main_grads()
    optimizer._copy_main_params_to_model_params()
    return _result(optimizer)


def _same(a, b) -> bool:
    """Same gradients (the same slices of main_grad) and the same parameter buffers bitwise."""
    (grads_a, data_a), (grads_b, data_b) = a, b
    return all(
        own_x and own_y and torch.equal(x, y) and offset_x == offset_y
        for (x, offset_x, own_x), (y, offset_y, own_y) in zip(grads_a, grads_b, strict=True)
    ) and all(torch.equal(x, y) for x, y in zip(data_a, data_b, strict=True))


def test_cached_copies_are_megatrons_bit_for_bit():
    """Every shard's ``.grad`` the same slice of ``main_grad``, every updated shard rounded into
    the same place of the parameter buffer; over two steps with new shard values."""
    ours, theirs = StandIn(), StandIn()
    assert cache_shard_copies(ours) is None
    for step in range(2):
        for a, b in zip(ours.shards(), theirs.shards(), strict=True):
            value = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
            a.data.copy_(value)
            b.data.copy_(value)
        mine, megatron = _ours(ours), _megatron(theirs)
        assert _same(mine, megatron)
        assert all(bool(d.ne(0).any()) for d in mine[1])  # something was copied


@pytest.mark.parametrize(
    "change",
    [
        pytest.param("main_grad", id="new-main-grad"),
        pytest.param("param_data", id="new-param-buffer"),
        pytest.param("shard", id="new-shard"),
        pytest.param("param", id="new-model-parameter"),
    ],
)
def test_views_are_taken_again_when_a_tensor_is_replaced(change, monkeypatch):
    """A ``main_grad``, parameter buffer, shard or model parameter replaced after the views were
    taken: the next copy takes them again and matches megatron's. Control: views kept
    regardless write into (or read from) the tensors that were replaced."""

    def replace(optimizer: StandIn) -> None:
        if change == "main_grad":
            optimizer.p1.main_grad = optimizer.p1.main_grad.clone() + 1.0
        elif change == "param_data":
            bucket = optimizer.buffers[0].buckets[0]
            bucket.param_data = torch.zeros_like(bucket.param_data)
        elif change == "shard":
            group = optimizer.shard_fp32_groups[0]
            group[0] = torch.nn.Parameter(group[0].detach() + 1.0)
        else:  # another parameter object in the model group, its own main_grad
            old = optimizer.p1
            new = torch.nn.Parameter(old.detach().clone())
            new.main_grad = old.main_grad.clone() + 1.0
            optimizer.model_float16_groups[0][1] = optimizer.p1 = new
            optimizer.model_param_gbuf_map[new] = optimizer.model_param_gbuf_map[old]
            param_map = optimizer.gbuf_ranges[0][torch.bfloat16][0]["param_map"]
            param_map[new] = param_map[old]

    ours, theirs = StandIn(), StandIn()
    cache_shard_copies(ours)
    _ours(ours)
    replace(ours)
    replace(theirs)
    assert _same(_ours(ours), _megatron(theirs))

    stale, theirs = StandIn(), StandIn()
    cache_shard_copies(stale)
    _ours(stale)
    replace(stale)
    replace(theirs)
    monkeypatch.setattr(ShardViews, "current", lambda self: True)
    assert not _same(_ours(stale), _megatron(theirs))


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        pytest.param("fp8", "FP8 or NVFP4", id="fp8-param-gather"),
        pytest.param("precision", "precision-aware", id="precision-aware"),
        pytest.param("bf16-grads", "main_grad in torch.bfloat16", id="bf16-main-grad"),
        pytest.param("stub", "stub", id="stub"),
    ],
)
def test_what_megatron_copies_another_way_keeps_its_methods(setting, reason):
    optimizer = StandIn()
    if setting == "fp8":
        optimizer.ddp_config.fp8_param_gather = True
    elif setting == "precision":
        optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    elif setting == "bf16-grads":
        optimizer.p0.main_grad = optimizer.p0.main_grad.bfloat16()
    else:
        optimizer.is_stub_optimizer = True
    assert reason in cache_shard_copies(optimizer)
    assert "_copy_main_params_to_model_params" not in vars(optimizer)
    assert cache_shard_copies(object()).startswith("object is not megatron's")


@pytest.mark.parametrize(
    ("value", "enabled"),
    [pytest.param(None, False, id="unset"), pytest.param("0", False, id="zero"),
     pytest.param("1", True, id="one")],
)  # fmt: skip
def test_the_cached_copies_are_opt_in(value, enabled):
    from megatron_hybrid.training.shard_copies import (
        CACHED_SHARD_COPIES_ENV,
        cached_shard_copies_enabled,
    )

    environ = {} if value is None else {CACHED_SHARD_COPIES_ENV: value}
    assert cached_shard_copies_enabled(environ) is enabled

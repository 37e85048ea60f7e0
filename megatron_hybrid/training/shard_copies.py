"""The distributed optimizer's two copies between model and main parameters, over views taken
once and in one multi-tensor copy.

megatron-core 0.19.2's ``DistributedOptimizer`` (``optimizer/distrib_optimizer.py``) walks its
parameters in Python twice a step:

* ``_copy_model_grads_to_main_grads`` (from ``prepare_grads``) looks up each parameter's range
  and points its float32 shard's ``.grad`` at that slice of ``main_grad``;
* ``_copy_main_params_to_model_params`` (after the update) looks the range up again and copies
  each updated shard into the model's bfloat16 parameter buffer, one ``copy_`` and one kernel
  per parameter.

At ``benchmarks/mfu.py``'s issue shape (one H200, 2026-11-29, ``[*E]``, 550 parameters) that is
9.1 and 20.7 ms of host time a step and 735 copy kernels (2.4 ms on the GPU). A step that
waits on the host (``train`` without CUDA graphs) pays the host time in full.

:func:`cache_shard_copies` gives each such optimizer (its instance, not the class) the same two
methods over views computed once: the ``.grad`` of every shard set to its cached slice of
``main_grad`` (the tensor megatron's ``.float()`` returns for a float32 gradient) and the shards
copied into the buffer with one ``torch._foreach_copy_`` (the same rounding per element, so the
same bits). Each step first checks, by identity, that the shards, every parameter's
``main_grad`` and every bucket's ``param_data`` are the tensors the views were taken from, and
takes them again where one changed. Optimizers that megatron copies another way (Megatron-FSDP,
the precision-aware optimizer, FP8 or NVFP4 parameters, gradients not in float32, stubs) keep
megatron's methods, and :func:`cache_shard_copies` says why.

It is off unless ``MEGATRON_HYBRID_CACHED_SHARD_COPIES=1``: with CUDA graphs the ``[*E]`` step
was about 2 ms shorter (one H200), but eager steps, which wait on the host, measured slower in
four of five A/B pairs, by more than the host time removed, and no cause was found
(``docs/performance.md``, round 11). It becomes the default once an A/B settles that.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from megatron_hybrid.training.optimizer_step import sub_optimizers

__all__ = [
    "CACHED_SHARD_COPIES_ENV",
    "ShardViews",
    "cache_shard_copies",
    "cached_shard_copies_enabled",
    "shard_copies_reason",
]

#: ``1`` installs the cached copies in ``train``'s optimizer (off by default, see above).
CACHED_SHARD_COPIES_ENV = "MEGATRON_HYBRID_CACHED_SHARD_COPIES"


def cached_shard_copies_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``build_optimizer`` installs the cached copies (the variable set to ``1``)."""
    return environ.get(CACHED_SHARD_COPIES_ENV, "0") == "1"


def shard_copies_reason(optimizer) -> str | None:
    """Why ``optimizer`` (one megatron optimizer, not a chain) keeps megatron's copies, or None."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer):
        return f"{type(optimizer).__name__} is not megatron's DistributedOptimizer"
    if optimizer.is_stub_optimizer:
        return "a stub (no parameters on this rank)"
    ddp, config = optimizer.ddp_config, optimizer.config
    if ddp.use_megatron_fsdp:
        return "Megatron-FSDP copies its own weights"
    if config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return "the precision-aware optimizer copies its own weights"
    if ddp.fp8_param_gather or getattr(ddp, "fp4_param_gather", False):
        return "FP8 or NVFP4 parameter gathers quantize the shards"
    from megatron.core.fp4_utils import is_nvfp4tensor

    for param, shard in _pairs(optimizer):
        if optimizer._is_distopt_quantized_param(param) or is_nvfp4tensor(param):
            return f"a quantized parameter ({type(param).__name__})"
        if param.main_grad.dtype != torch.float32:
            return f"main_grad in {param.main_grad.dtype} (the shard's .grad is a copy)"
        if shard.device != param.main_grad.device:
            return f"main parameters on {shard.device}, gradients on {param.main_grad.device}"
    return None


def _pairs(optimizer):
    """``(model parameter, main-parameter shard)`` in megatron's order of the two groups."""
    for model_groups, shard_groups in (
        (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
        (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
    ):
        for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
            yield from zip(model_group, shard_group, strict=True)


class ShardViews:
    """Each shard's slice of ``main_grad`` and of the parameter buffer, taken once.

    Args:
        optimizer: a megatron ``DistributedOptimizer`` that :func:`shard_copies_reason` accepts.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.take()

    def take(self) -> None:
        """Take the views (megatron's range look-ups, once)."""
        opt = self.optimizer
        self.shards, self.grad_views, self.param_views = [], [], []
        self.main_grads, self.buckets = [], {}
        for model_param, shard in _pairs(opt):
            ranges = opt._get_model_param_range_map(model_param)
            param_range, world_range = ranges["param"], ranges["gbuf_world_in_bucket"]
            if param_range.size != shard.nelement() or world_range.size != shard.nelement():
                raise ValueError(
                    f"a shard of {shard.nelement()} elements for ranges of {param_range.size} "
                    f"and {world_range.size}: the optimizer's layout is not the buffers'"
                )
            gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
            bucket = opt.buffers[gbuf_index].buckets[bucket_id]
            self.buckets[id(bucket)] = (bucket, bucket.param_data)
            self.shards.append(shard)
            self.main_grads.append((model_param, model_param.main_grad))
            self.grad_views.append(
                model_param.main_grad.view(-1)[param_range.start : param_range.end]
            )
            self.param_views.append(bucket.param_data.view(-1)[world_range.start : world_range.end])

    def current(self) -> bool:
        """Whether the parameters, shards, main grads and parameter buffers are those the views
        are of."""
        pairs = list(_pairs(self.optimizer))
        return (
            len(pairs) == len(self.shards)
            and all(
                param is cached_param and shard is cached_shard and param.main_grad is grad
                for (param, shard), cached_shard, (cached_param, grad) in zip(
                    pairs, self.shards, self.main_grads, strict=True
                )
            )
            and all(b.param_data is d for b, d in self.buckets.values())
        )

    def refresh(self) -> None:
        if not self.current():
            self.take()

    def copy_model_grads_to_main_grads(self) -> None:
        """megatron's method: every shard's ``.grad`` the slice of its parameter's ``main_grad``."""
        self.refresh()
        for shard, view in zip(self.shards, self.grad_views, strict=True):
            shard.grad = view

    @torch.no_grad()
    def copy_main_params_to_model_params(self) -> None:
        """megatron's method: every updated shard into the parameter buffer, one multi-tensor
        copy."""
        self.refresh()
        if self.shards:
            torch._foreach_copy_(self.param_views, self.shards)


def cache_shard_copies(optimizer) -> str | None:
    """Give every ``DistributedOptimizer`` in ``optimizer`` (megatron's, or its
    ``ChainedOptimizer``) the two copies over cached views; None, or why one keeps megatron's."""
    reasons = []
    for sub in sub_optimizers(optimizer):
        reason = shard_copies_reason(sub)
        if reason is not None:
            reasons.append(reason)
            continue
        views = ShardViews(sub)
        # Instance attributes: megatron calls ``self._copy_...()``, which finds these first.
        sub._copy_model_grads_to_main_grads = views.copy_model_grads_to_main_grads
        sub._copy_main_params_to_model_params = views.copy_main_params_to_model_params
    return "; ".join(reasons) or None

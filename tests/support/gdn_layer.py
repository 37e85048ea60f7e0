"""One GatedDeltaNet layer of the small test config, and one forward-backward of it, for the
tests that compare the layer's ways of calling its rule (CPU stand-ins and fla's kernels alike).
"""

from __future__ import annotations

import torch

#: Query/key heads shared by twice as many value heads (fla's grouped value attention).
KEY_HEADS, VALUE_HEADS = 2, 4


def build_gated_delta_net(pg, layer_class=None, **overrides):
    """One ``HybridGatedDeltaNet`` (or ``layer_class``) of ``small_config("G", **overrides)``."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_hybrid.modules.gated_delta_net import HybridGatedDeltaNet
    from megatron_hybrid.modules.norms import local_norm_impl, plain_gamma_norm
    from megatron_hybrid.testing.models import small_config

    submodules = GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear,
        out_norm=plain_gamma_norm(local_norm_impl()),
        out_proj=RowParallelLinear,
    )
    spec = ModuleSpec(module=layer_class or HybridGatedDeltaNet, submodules=submodules)
    config = small_config("G", **overrides)
    return build_module(spec, config=config, layer_number=1, pg_collection=pg)


def packed_params(lengths, device="cpu"):
    """megatron's ``PackedSeqParams`` of one THD row holding sequences of ``lengths``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    bounds = bounds.to(device)
    longest = max(lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


def layer_step(layer, hidden, packed_seq_params=None) -> dict[str, torch.Tensor]:
    """The layer's output (``"out"``) and every parameter's gradient of ``out.sum()``."""
    layer.zero_grad(set_to_none=True)
    out, _ = layer(hidden, attention_mask=None, packed_seq_params=packed_seq_params)
    out.float().sum().backward()
    return {"out": out.detach(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def tiled(rule):
    """``rule`` with the query/key heads shared in the other order a grouping could take (value
    head ``i`` reading key head ``i % H``, what ``Tensor.repeat`` makes): a negative control."""

    def call(q, k, v, **kwargs):
        group = v.shape[2] // q.shape[2]
        return rule(q.repeat(1, 1, group, 1), k.repeat(1, 1, group, 1), v, **kwargs)

    return call

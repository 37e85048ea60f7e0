"""Compare parameters across parallel layouts through their checkpoint keys."""

from __future__ import annotations

import torch

__all__ = [
    "assemble_global_tensors",
    "grads_by_checkpoint_key",
    "local_shard_mismatches",
    "sharded_metadata",
]


def _sharded_tensors(sharded_state_dict):
    """ShardedTensors of a (possibly nested, e.g. per VPP chunk) sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]


def assemble_global_tensors(sharded_state_dict) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the whole (global) tensor, from a rank that holds every shard.

    Raises:
        ValueError: a part of some global tensor is not held here.
    """
    buffers: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for st in _sharded_tensors(sharded_state_dict):
        if st.flattened_range is not None:
            raise ValueError(f"{st.key}: flattened shards are not supported here")
        buf = buffers.setdefault(st.key, torch.zeros(st.global_shape, dtype=st.dtype))
        mask = filled.setdefault(st.key, torch.zeros(st.global_shape, dtype=torch.bool))
        buf[st.global_slice()] = st.data.detach().cpu().reshape(buf[st.global_slice()].shape)
        mask[st.global_slice()] = True
    missing = [key for key, mask in filled.items() if not bool(mask.all())]
    if missing:
        raise ValueError(f"these tensors are only partly held on this rank: {missing[:5]}")
    return buffers


def local_shard_mismatches(sharded_state_dict, reference: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose local shard is not bitwise equal to the same slice of ``reference``."""
    bad = []
    for st in _sharded_tensors(sharded_state_dict):
        expected = reference[st.key][st.global_slice()]
        if not torch.equal(st.data.detach().cpu().reshape(expected.shape), expected):
            bad.append(f"{st.key}{tuple(st.global_offset)}")
    return bad


def sharded_metadata(sharded_state_dict) -> dict:
    """Checkpoint key -> what a ``torch_dist`` checkpoint records about it.

    Two models whose results are equal save checkpoints that load into each other: the same
    keys, global shapes, global offsets, fragmentations and dtypes.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            out[value.key] = (
                "tensor",
                tuple(value.global_shape),
                tuple(value.global_offset),
                tuple(value.axis_fragmentations),
                value.dtype,
            )
        elif isinstance(value, ShardedObject):
            out[value.key] = ("object", tuple(value.global_shape), tuple(value.global_offset))
        else:
            raise TypeError(f"unexpected sharded entry {type(value).__name__}")
    return out


def grads_by_checkpoint_key(model) -> dict[tuple, torch.Tensor]:
    """``(checkpoint key, global offset)`` -> the local gradient of that parameter.

    Module paths differ between GPTModel and a grouped HybridModel; checkpoint keys do not, so
    gradients of the two are compared through them.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    params = dict(model.named_parameters())
    out = {}
    for local_key, value in model.sharded_state_dict().items():
        param = params.get(local_key)
        if isinstance(value, ShardedTensor) and param is not None and param.grad is not None:
            out[(value.key, value.global_offset)] = param.grad
    return out

"""NaN and infinity, found by name: in tensors, in (sharded) state dicts, on any rank.

The checkpoint store refuses to write or load a non-finite tensor, the Hugging Face read path a
non-finite source value, and the training guard names the first non-finite parameter or
gradient; all three ask the functions here. Flags are reduced on the device before one host
synchronisation, and names are looked at (and sent between ranks) only when something is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

__all__ = [
    "collective_device",
    "first_nonfinite",
    "named_leaves",
    "nonfinite_on_any_rank",
    "state_tensors",
    "tensor_is_finite",
]

# float8 types torch.isfinite does not take (e4m3 has NaN but no infinity).
_UPCAST = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def tensor_is_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the tensor's device: no NaN or infinity in it (no host sync)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.dtype in _UPCAST:
        tensor = tensor.float()
    return torch.isfinite(tensor).all()


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or infinity, None if all are finite."""
    items = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    if not items:
        return None
    flags = [tensor_is_finite(t) for _, t in items]
    finite = torch.stack([f.to(flags[0].device) for f in flags])
    if bool(finite.all()):
        return None
    return items[int((~finite).nonzero()[0, 0])][0]


def named_leaves(tree, path: str = "") -> Iterator[tuple[str, object]]:
    """``(dotted path, leaf)`` of every leaf of nested dicts, lists and tuples."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from named_leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from named_leaves(value, f"{path}.{i}" if path else str(i))
    else:
        yield path, tree


def state_tensors(state) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a (sharded) state dict: the checkpoint key of sharded entries, the
    dotted path of plain tensors; objects (RNG state, pickled values) are left out."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for path, leaf in named_leaves(state):
        if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)):
            if isinstance(leaf.data, torch.Tensor):
                yield leaf.key, leaf.data
        elif isinstance(leaf, torch.Tensor):
            yield path, leaf


def collective_device(group=None) -> torch.device | str:
    """Where a small tensor for a collective over ``group`` must live (NCCL: this GPU)."""
    backend = torch.distributed.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"


def nonfinite_on_any_rank(local: str | None, group=None) -> tuple[str, int] | None:
    """``(name, rank)`` of the lowest rank's non-finite tensor, None if every rank is finite.

    Collective over ``group`` (default: the world); ``local`` is this rank's
    :func:`first_nonfinite`.
    """
    bad = torch.tensor([float(local is not None)], device=collective_device(group))
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=group)
    if not bad.item():
        return None
    names: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(names, local, group=group)
    rank = next(r for r, name in enumerate(names) if name is not None)
    return names[rank], rank

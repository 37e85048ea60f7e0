"""Where an adapter's tensors sit in the checkpoint key space, read off the base's sharded
state dict.

megatron's ``sharded_state_dict`` says which rows of which global checkpoint tensor each
local weight holds: one ``ShardedTensor`` per weight, or a factory that cuts it into row
ranges (SwiGLU's gate and up halves under TP, GatedDeltaNet's ``in_proj`` pieces). ``B`` has
the weight's rows, so its boxes are the weight's with ``r`` columns and ``lora_B`` in the key;
``A`` is one tensor per weight (``lora_A`` in the key of the factory or tensor), column-sharded
like the weight for row-parallel layers and replicated otherwise. Keys, global shapes and
offsets are the base's, so an adapter checkpoint reshards over TP / EP / PP as the base does
and follows the base's key form (indexed or layer-stacked).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["RowChunk", "adapter_entries", "lora_key", "row_chunks", "weight_entries"]


def lora_key(key: str, which: str) -> str:
    """``...linear_qkv.weight`` -> ``...linear_qkv.lora_B.weight`` (``which`` is A or B); the
    last ``.weight`` names the parameter (``in_proj.weight.query`` -> ``in_proj.lora_B.weight.
    query``; grouped experts' ``weight`` likewise)."""
    head, sep, tail = key.rpartition(".weight")
    if not sep:
        raise AssertionError(f"{key}: not a weight key")  # adapted tensors are weights
    return f"{head}.lora_{which}.weight{tail}"


@dataclass(frozen=True)
class RowChunk:
    """Rows ``local_start : local_start + rows`` of a local weight are rows ``global_start:``
    of checkpoint tensor ``template.key`` (``template``: its ShardedTensor, data dropped)."""

    local_start: int
    rows: int
    global_start: int
    template: object

    @property
    def key(self) -> str:
        return self.template.key

    @property
    def expert(self) -> int | None:
        """The expert index of an expert tensor in the indexed key form (its one leading
        axis), else None."""
        t = self.template
        return int(t.global_offset[0]) if t.prepend_axis_num == 1 else None


def weight_entries(sharded: dict, params) -> dict[int, object]:
    """``id(param) -> ShardedTensor or factory`` whose data is ``param``, for ``params``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    wanted = {id(p) for p in params}
    found = {}
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor | ShardedTensorFactory) and id(value.data) in wanted:
            found[id(value.data)] = value
    return found


def row_chunks(entry, param: torch.Tensor) -> list[RowChunk]:
    """The row ranges of ``param`` that ``entry`` (its tensor or factory) maps, in local order."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    built = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
    leaves = list(nested_values(built)) if isinstance(built, dict | list) else [built]
    chunks = []
    for st in leaves:
        data = st.data
        # Views of the weight (megatron's factories chunk and narrow it): element offsets, which
        # meta tensors (shape-only builds) have too.
        offset = data.storage_offset() - param.storage_offset()
        if (
            data.shape[1:] != param.shape[1:]
            or data.stride() != param.stride()
            or offset % param.stride(0)
            or offset < 0
            or (not param.is_meta and data.untyped_storage().data_ptr()
                != param.untyped_storage().data_ptr())
        ):  # fmt: skip
            raise AssertionError(f"{st.key}: not a row range of its weight")  # megatron cuts rows
        axis = st.prepend_axis_num
        chunks.append(
            RowChunk(
                local_start=offset // param.stride(0),
                rows=data.shape[0],
                global_start=int(st.global_offset[axis]),
                template=st.without_data(),
            )
        )
    chunks.sort(key=lambda c: c.local_start)
    if sum(c.rows for c in chunks) != param.shape[0]:
        raise AssertionError(f"{entry.key}: the sharded tensors do not cover the weight")
    return chunks


def _replicated(replica_id, tp_rank: int):
    """The replica id of a tensor replicated over the TP group (megatron's ``(0, tp, dp)``)."""
    if isinstance(replica_id, tuple) and len(replica_id) == 3:
        return (replica_id[0], tp_rank, replica_id[2])
    raise AssertionError(f"unexpected replica id {replica_id!r}")  # megatron's form


def adapter_entries(entry_key: str, chunks: list[RowChunk], weight, a, b, tp_rank, mode) -> tuple:
    """The checkpoint entries ``(A, B)`` of the adapter of ``weight``.

    Args:
        entry_key: the key of the weight's ShardedTensor or factory (any key form).
        chunks: its :func:`row_chunks` in that key form.
        weight: the local weight.
        a: ``A`` ``[blocks * r, in_local]``.
        b: ``B`` ``[out_local, r]``.
        tp_rank: rank in the layer's TP group (replicated adapter tensors are written once).
        mode: the layer's parallel mode (``column``, ``row``, ``duplicated``).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    first = chunks[0].template
    p = first.prepend_axis_num
    tp_split = mode in ("column", "row") and first.replica_id[1] == 0
    # A: [blocks * r, in]; split over TP like the weight's columns for row-parallel layers.
    in_global, in_offset, in_frag = (
        first.global_shape[p + 1],
        first.global_offset[p + 1],
        first.axis_fragmentations[p + 1],
    )
    a_replica = first.replica_id if mode == "row" or not tp_split else None
    a_entry = dataclasses.replace(
        first,
        key=lora_key(entry_key, "A"),
        data=a,
        dtype=a.dtype,
        local_shape=tuple(a.shape),
        global_shape=(*first.global_shape[:p], a.shape[0], in_global),
        global_offset=(*first.global_offset[:p], 0, in_offset),
        axis_fragmentations=(*first.axis_fragmentations[:p], 1, in_frag),
        replica_id=a_replica or _replicated(first.replica_id, tp_rank),
        flattened_range=None,
    )
    # B: the weight's rows, r columns; replicated over TP for row-parallel layers.
    b_replica = _replicated(first.replica_id, tp_rank) if mode == "row" and tp_split else None
    rank = b.shape[1]

    def b_tensor(key: str, chunk: RowChunk, data: torch.Tensor):
        t = chunk.template
        return dataclasses.replace(
            t,
            key=key,
            data=data,
            dtype=data.dtype,
            local_shape=tuple(data.shape),
            global_shape=(*t.global_shape[: p + 1], rank),
            global_offset=(*t.global_offset[: p + 1], 0),
            axis_fragmentations=(*t.axis_fragmentations[: p + 1], 1),
            replica_id=b_replica or t.replica_id,
            flattened_range=None,
        )

    base_key = lora_key(entry_key, "B")
    if len(chunks) == 1 and chunks[0].rows == weight.shape[0] and chunks[0].key == entry_key:
        return a_entry, b_tensor(base_key, chunks[0], b)
    suffixes = []
    for chunk in chunks:
        key = lora_key(chunk.key, "B")
        if not key.startswith(base_key):
            raise AssertionError(f"{chunk.key} is not under {entry_key}")  # megatron's factories
        suffixes.append(key[len(base_key) :])

    def build(key, data, replica_id=None, flattened_range=None):
        return [
            b_tensor(key + suffix, chunk, data[chunk.local_start : chunk.local_start + chunk.rows])
            for suffix, chunk in zip(suffixes, chunks, strict=True)
        ]

    def merge(parts):
        return torch.cat(list(parts), dim=0)

    b_entry = ShardedTensorFactory(base_key, b, build, merge, replica_id=first.replica_id)
    return a_entry, b_entry

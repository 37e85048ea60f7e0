"""Every rank's adapter tensors as global checkpoint-key tensors, assembled on demand.

Each rank contributes the boxes its adapters occupy in the checkpoint key space
(:func:`~megatron_hybrid.peft.layout.adapter_entries`, indexed key form) and a record per
adapted weight; the box table is all-gathered once and kept while the parameters stay where
they are (an RL loop syncs after every step). A global tensor is then assembled by one
broadcast per box from the rank that holds it (its main replica), on every rank, as
``megatron_hybrid.hf.iter_hf_weights`` assembles the base's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_hybrid.hf.plan import FusedExperts
from megatron_hybrid.hf.weights import ShardBox, model_chunks
from megatron_hybrid.peft.apply import lora_parameters, lora_state
from megatron_hybrid.peft.layout import adapter_entries

__all__ = ["AdapterRecord", "AdapterTensors", "adapter_tensors"]


@dataclass(frozen=True)
class AdapterRecord:
    """One adapted weight, the same on every rank.

    Attributes:
        a_key: the checkpoint key of its ``A``; with ``expert``, the weight's identity.
        expert: the global expert index of an expert weight, else None.
        pieces: the pieces that have an adapter, in ``A`` block order.
        shared_a: one ``A`` block for all pieces.
        fused: the in-memory 3-D parameter of a routed expert weight.
        symbol: the pattern symbol of its layer.
        name: the Megatron target name.
        path: its module path (in its model chunk).
        rank: the adapter rank.
    """

    a_key: str
    expert: int | None
    pieces: tuple[str, ...]
    shared_a: bool
    fused: FusedExperts | None
    symbol: str
    name: str
    path: str
    rank: int

    def block(self, piece: str) -> int:
        """The ``A`` block of ``piece``."""
        return 0 if self.shared_a else self.pieces.index(piece)


def _local_boxes(state, tp_rank_of) -> tuple[dict, list[AdapterRecord]]:
    """``{(key, expert, offset): data}`` and records of one chunk's adapters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, is_main_replica

    local, records = {}, []
    for cand in state.adapted:
        adapter = cand.module.lora
        for i, (weight, pieces) in enumerate(zip(cand.info.weights, cand.weights, strict=True)):
            a, b = adapter.a(i), adapter.b(i)
            entries = adapter_entries(
                pieces.entry_key, pieces.chunks, weight, a, b, tp_rank_of(cand), cand.info.mode
            )
            for entry in entries:
                built = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
                for st in nested_values(built) if isinstance(built, dict) else built:
                    if not is_main_replica(st.replica_id):
                        continue
                    expert = int(st.global_offset[0]) if st.prepend_axis_num == 1 else None
                    offset = tuple(int(o) for o in st.global_offset[st.prepend_axis_num :])
                    local[(st.key, expert, offset)] = st.data
            active = [cand.pieces[j] for j in sorted(cand.active)]
            records.append(
                AdapterRecord(
                    a_key=pieces.a_key,
                    expert=pieces.expert,
                    pieces=tuple(active),
                    shared_a=adapter.blocks == 1 and len(active) > 1,
                    fused=pieces.fused,
                    symbol=cand.symbol,
                    name=cand.name,
                    path=cand.path,
                    rank=adapter.rank,
                )
            )
    return local, records


class AdapterTensors:
    """The model's adapters as global tensors in the checkpoint key space.

    Build it on every rank of ``group`` together; :meth:`full` is collective too (call it in
    the same order on every rank).
    """

    def __init__(self, model, group=None) -> None:
        import torch.distributed as dist

        self.group = group
        self.world = dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        chunks = model_chunks(model)
        self.local: dict = {}
        records: list[AdapterRecord] = []
        for chunk in chunks:
            state = getattr(chunk, "lora_state", None)
            if state is None:
                continue
            local, recs = _local_boxes(state, lambda cand: cand.info.tp_rank)
            self.local.update(local)
            records += recs
        meta = (
            [
                ShardBox(k, e, o, tuple(t.shape), t.dtype, self.rank)
                for (k, e, o), t in self.local.items()
            ],
            records,
        )
        gathered = [meta]
        if self.world:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, meta, group=group)
        self.boxes: dict[tuple[str, int | None], dict[tuple, ShardBox]] = {}
        self.records: dict[tuple[str, int | None], AdapterRecord] = {}
        for boxes, recs in gathered:
            for box in boxes:  # lowest rank wins among replicas
                self.boxes.setdefault((box.key, box.expert), {}).setdefault(box.offset, box)
            for rec in recs:
                self.records.setdefault((rec.a_key, rec.expert), rec)
        self.params = lora_parameters(model)
        self.ptrs = [p.data_ptr() for p in self.params]

    def valid(self) -> bool:
        """Whether the parameters are still where they were when this was built."""
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.ptrs, strict=True))

    def shape(self, key: str, expert: int | None) -> tuple[int, ...]:
        """The global shape of adapter tensor ``key`` (expert ``expert``)."""
        boxes = list(self.boxes[(key, expert)].values())
        return tuple(
            max(b.offset[d] + b.shape[d] for b in boxes) for d in range(len(boxes[0].shape))
        )

    def full(self, key: str, expert: int | None, device) -> torch.Tensor:
        """The global tensor ``key`` (expert ``expert``), on every rank."""
        import torch.distributed as dist

        boxes = self.boxes[(key, expert)]
        shape = self.shape(key, expert)
        first = next(iter(boxes.values()))
        if not self.world and len(boxes) == 1 and first.shape == shape:
            return self.local[(key, expert, first.offset)].detach().to(device)
        out = torch.empty(shape, dtype=first.dtype, device=device)
        for offset, box in boxes.items():
            index = tuple(slice(o, o + n) for o, n in zip(offset, box.shape, strict=True))
            if self.world:
                if box.rank == self.rank:
                    buf = self.local[(key, expert, offset)].detach().to(device).contiguous()
                else:
                    buf = torch.empty(box.shape, dtype=box.dtype, device=device)
                dist.broadcast(buf, src=box.rank, group=self.group)
            else:
                buf = self.local[(key, expert, offset)].detach()
            out[index] = buf
        return out


def adapter_tensors(model, group=None) -> AdapterTensors:
    """The model's :class:`AdapterTensors`, built once and reused while valid."""
    state = lora_state(model)
    cached = getattr(state, "_tensors", None)
    if cached is not None and cached.group is group and cached.valid():
        return cached
    tensors = AdapterTensors(model, group)
    for chunk in model_chunks(model):
        if getattr(chunk, "lora_state", None) is not None:
            chunk.lora_state._tensors = tensors
    return tensors

"""Which linears of a model can take an adapter, what Hugging Face pieces each is made of, and
which of them a :class:`~megatron_hybrid.peft.config.LoRAConfig` selects.

A fused Megatron weight is made of the Hugging Face tensors the conversion plan
(:mod:`megatron_hybrid.hf.plan`) cuts it into: ``linear_qkv`` of ``q_proj``/``k_proj``/
``v_proj`` rows (per query group, per head for Qwen3.5's gated ``q_proj``), ``linear_fc1`` of
``gate_proj``/``up_proj``, GatedDeltaNet's ``in_proj`` of ``in_proj_qkv``/``z``/``b``/``a``
(head-grouped ``in_proj_qkvz``/``in_proj_ba`` for Qwen3-Next), and so on. Each piece gets its
own adapter, placed on exactly the rows the plan gives it, shard for shard, which is what a
PEFT adapter of the Hugging Face model holds. A routed expert is one piece per weight: PEFT
adapts transformers' fused 3-D ``gate_up_proj`` / ``down_proj`` (one ``A`` for gate and up).
A model that did not come from Hugging Face has one piece per weight.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from megatron_hybrid.checkpointing.finite import collective_device
from megatron_hybrid.hf.plan import FusedExperts, Plan
from megatron_hybrid.modules.hybrid_stack import HybridStack
from megatron_hybrid.peft.config import ALL_LINEAR, MEGATRON_TARGETS, LoRAConfig, LoRAConfigError
from megatron_hybrid.peft.layout import RowChunk, lora_key, row_chunks, weight_entries
from megatron_hybrid.peft.linears import LinearInfo, linear_info

__all__ = ["Candidate", "WeightPieces", "find_candidates", "select_pieces"]

#: Module paths of MTP layers start so.
_MTP = "mtp."

#: (layer symbol, target) -> why an adapter there would never run.
_UNHOOKABLE = {
    ("D", "linear_kv_up_proj"): (
        "DeepSeek sparse attention ('D') multiplies linear_kv_up_proj's weight directly "
        "(megatron-core 0.19.2 absorbed_mla.py) instead of calling the layer, so an adapter "
        "there would never run"
    ),
}


@dataclass
class WeightPieces:
    """One local weight of a candidate and the pieces its rows belong to.

    Attributes:
        chunks: its row ranges in the checkpoint key space (indexed key form).
        pieces: every piece of the weight, in a layout-independent order: Hugging Face
            module names (``model.layers.0.self_attn.q_proj``), ``<experts module>.<param>``
            for a routed expert, or the checkpoint key without a conversion.
        row_piece: local row -> index into ``pieces``.
        fused: the routed experts' in-memory parameter, for expert weights.
        entry_key: the key of the weight's sharded tensor or factory.
    """

    chunks: list[RowChunk]
    pieces: tuple[str, ...]
    row_piece: torch.Tensor
    fused: FusedExperts | None
    entry_key: str

    @property
    def expert(self) -> int | None:
        return self.chunks[0].expert

    @property
    def a_key(self) -> str:
        """The checkpoint key of the weight's ``A`` (indexed key form)."""
        return lora_key(self.entry_key, "A")


@dataclass
class Candidate:
    """A linear that can take an adapter.

    Attributes:
        chunk: index of the model chunk (virtual pipeline stage) it lives in.
        path: its module path in that chunk.
        name: its Megatron target name (the attribute its parent keeps it under).
        symbol: the pattern symbol of the layer it belongs to.
        module: the linear.
        info: how it is parallel.
        weights: its local weights with their pieces.
        active: indices of the pieces selected for adapters (filled by :func:`select_pieces`).
    """

    chunk: int
    path: str
    name: str
    symbol: str
    module: torch.nn.Module
    info: LinearInfo
    weights: list[WeightPieces]
    active: set[int] = field(default_factory=set)

    @property
    def pieces(self) -> tuple[str, ...]:
        return self.weights[0].pieces

    @property
    def fused(self) -> FusedExperts | None:
        return self.weights[0].fused


def _physical_layers(model: torch.nn.Module) -> dict[int, str]:
    """``id(layer) -> symbol`` of every physical layer of every hybrid stack in ``model``."""
    symbols = {}
    for module in model.modules():
        if isinstance(module, HybridStack):
            for symbol, layer in module.iter_physical_layers():
                symbols[id(layer)] = symbol
    return symbols


def _walk(module, prefix: str, symbol: str, symbols: dict):
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        inner = symbols.get(id(child), symbol)
        yield path, name, inner, child
        yield from _walk(child, path + ".", inner, symbols)


def _pieces_of(chunks: list[RowChunk], key: str, plan: Plan | None):
    """``(pieces, row_piece, fused)`` of a weight with row ranges ``chunks``."""
    rows = sum(c.rows for c in chunks)
    if plan is None:
        return (key,), torch.zeros(rows, dtype=torch.long), None
    fused = plan.fused_experts.get(chunks[0].key)
    if fused is not None:
        return (f"{fused.module}.{fused.param}",), torch.zeros(rows, dtype=torch.long), fused
    names: list[str] = []
    for chunk in chunks:
        for link in plan.by_key.get((chunk.key, chunk.expert), ()):
            if link.hf_name not in names:
                names.append(link.hf_name)
    order = {name: i for i, name in enumerate(plan.hf_shapes)}
    names.sort(key=order.__getitem__)
    index = {name: i for i, name in enumerate(names)}
    row_piece = torch.full((rows,), -1, dtype=torch.long)
    for chunk in chunks:
        for link in plan.by_key.get((chunk.key, chunk.expert), ()):
            low = max(chunk.global_start, link.key_rows.start)
            high = min(chunk.global_start + chunk.rows, link.key_rows.stop)
            if low < high:
                start = chunk.local_start + low - chunk.global_start
                row_piece[start : start + high - low] = index[link.hf_name]
    if (row_piece < 0).any():
        raise AssertionError(f"{key}: rows without a Hugging Face source")  # plan covers all
    return tuple(n.removesuffix(".weight") for n in names), row_piece, None


def find_candidates(chunks: list, sharded: list[dict], plan: Plan | None) -> list[Candidate]:
    """The linears of ``chunks`` that can take an adapter, with their pieces.

    Args:
        chunks: the unwrapped model chunks of this rank.
        sharded: each chunk's sharded state dict (indexed key form).
        plan: the conversion plan (None for a model without a Hugging Face conversion).
    """
    found = []
    for index, (chunk, state) in enumerate(zip(chunks, sharded, strict=True)):
        symbols = _physical_layers(chunk)
        linears = []
        for path, name, symbol, module in _walk(chunk, "", "", symbols):
            if name not in MEGATRON_TARGETS:
                continue
            info = linear_info(module)
            if info is not None:
                linears.append((path, name, symbol, module, info))
        # One walk of the sharded state dict per chunk (a 256-expert model has ~20k linears).
        entries = weight_entries(state, [w for *_, info in linears for w in info.weights])
        for path, name, symbol, module, info in linears:
            weights = []
            for weight in info.weights:
                entry = entries.get(id(weight))
                if entry is None:  # a linear outside the checkpoint cannot be adapted
                    raise AssertionError(f"{path}: weight not in the sharded state dict")
                rows = row_chunks(entry, weight)
                pieces, row_piece, fused = _pieces_of(rows, entry.key, plan)
                weights.append(WeightPieces(rows, pieces, row_piece, fused, entry.key))
            found.append(Candidate(index, path, name, symbol, module, info, weights))
    return found


def _leaf(piece: str) -> str:
    return piece.rsplit(".", 1)[-1]


class _Index:
    """The candidates by every name a target can give them (lookups, so that the thousands of
    piece names a large PEFT file holds resolve quickly)."""

    def __init__(self, candidates: list[Candidate]) -> None:
        self.candidates = candidates
        self.by_name: dict[str, list] = {}
        self.by_suffix: dict[str, list] = {}
        self.by_piece: dict[str, list] = {}
        self.by_leaf: dict[str, list] = {}
        for cand in candidates:
            every = set(range(len(cand.pieces)))
            self.by_name.setdefault(cand.name, []).append((cand, every))
            parts = cand.path.split(".")
            for i in range(len(parts)):
                self.by_suffix.setdefault(".".join(parts[i:]), []).append((cand, every))
            if cand.fused is not None:  # routed experts: experts.<param> as PEFT names them
                self.by_suffix.setdefault(f"experts.{cand.fused.param}", []).append((cand, every))
            for i, piece in enumerate(cand.pieces):
                self.by_piece.setdefault(piece, []).append((cand, {i}))
                if cand.fused is None:
                    self.by_leaf.setdefault(_leaf(piece), []).append((cand, {i}))

    def resolve(self, target: str) -> list[tuple[Candidate, set[int]]]:
        """``(candidate, piece indices)`` that ``target`` selects.

        MTP layers only for targets that name them (``mtp.*``, ``mtp.layers.0.<...>``): the
        Hugging Face model has no MTP modules, so ``all-linear`` and names there, as peft reads
        them, never reach them, and a PEFT folder could not hold their adapters.
        """
        if target == ALL_LINEAR:
            found = [(c, set(range(len(c.pieces)))) for c in self.candidates]
        elif any(ch in target for ch in "*?["):
            found = [
                (c, set(range(len(c.pieces))))
                for c in self.candidates
                if fnmatch.fnmatchcase(c.path, target) or fnmatch.fnmatchcase(c.path, "*." + target)
            ]
        else:
            found = self.by_name.get(target, []) + self.by_piece.get(target, [])
            found += (
                self.by_suffix.get(target, []) if "." in target else self.by_leaf.get(target, [])
            )
        if target.startswith(_MTP):
            return found
        return [(c, pieces) for c, pieces in found if not c.path.startswith(_MTP)]


def select_pieces(candidates: list[Candidate], config: LoRAConfig, group=None) -> list[Candidate]:
    """Mark the pieces ``config`` selects; return the candidates with at least one.

    Collective over ``group`` (default: the world): a target must match something on some
    rank (pipeline stages hold different layers).

    Raises:
        LoRAConfigError: a target or exclude matches nothing, or selects a linear whose
            adapter would never run.
    """
    index = _Index(candidates)
    names = list(config.targets) + list(config.exclude)
    hits = torch.zeros(len(names), dtype=torch.float64)
    for cand in candidates:
        cand.active = set()
    for i, target in enumerate(config.targets):
        for cand, pieces in index.resolve(target):
            hits[i] += len(pieces)
            cand.active |= pieces
    for j, target in enumerate(config.exclude):
        for cand, pieces in index.resolve(target):
            hits[len(config.targets) + j] += len(pieces)
            cand.active -= pieces
    if torch.distributed.is_initialized():
        # NCCL reduces only CUDA tensors.
        device = collective_device(group)
        reduced = hits.to(device)
        torch.distributed.all_reduce(reduced, group=group)
        hits = reduced.cpu()
    missing = [name for name, count in zip(names, hits.tolist(), strict=True) if not count]
    if missing:
        leaves = sorted(index.by_leaf)
        shown = missing if len(missing) <= 10 else [*missing[:10], f"... {len(missing) - 10} more"]
        raise LoRAConfigError(
            f"LoRA targets {shown} match nothing in this model (an unmatched target would "
            f"silently leave those weights without an adapter). Megatron targets: "
            f"{sorted(MEGATRON_TARGETS)}; Hugging Face names of this model: {leaves or 'none'}"
            "; routed experts also as experts.<param>; or module paths with wildcards"
        )
    for cand in candidates:
        reason = _UNHOOKABLE.get((cand.symbol, cand.name))
        if cand.active and reason:
            raise LoRAConfigError(
                f"{cand.path}: {reason}; leave it out with exclude=['{cand.path}']"
            )
    return [c for c in candidates if c.active]

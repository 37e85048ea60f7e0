"""Weights out: ``iter_hf_weights`` streams the model's weights in the Hugging Face names and
layouts, one tensor at a time, gathered from the boxes of all ranks (no rank holds more than the
tensor being yielded and the checkpoint tensors it is cut from), unquantized, as loaded or with
the family's FP8 recipe, with LoRA updates merged where asked."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_hybrid.hf.config import HFConversion
from megatron_hybrid.hf.fp8 import FP8_DTYPE, SCALE_SUFFIX
from megatron_hybrid.hf.fp8_stream import BucketQuantizer, FP8Spec, fp8_specs
from megatron_hybrid.hf.io import parse_size
from megatron_hybrid.hf.plan import Link, Plan, build_plan, check_plan
from megatron_hybrid.hf.weights import (
    LORA_DELTA,
    QUANTIZE_MODES,
    HFWeightsError,
    ShardBox,
    expert_index,
    model_chunks,
    sharded_leaves,
    sharded_tensors,
)

__all__ = ["iter_hf_weights"]


def _target_dtype(name: str, plan: Plan, conversion, dtype, source_dtypes, piece_dtype):
    if name in plan.keep_fp32:
        return torch.float32
    if dtype is not None:
        return dtype
    if source_dtypes and name in source_dtypes:
        # An FP8 source tensor written unquantized: in the parameters' dtype.
        return piece_dtype if source_dtypes[name] == FP8_DTYPE else source_dtypes[name]
    if piece_dtype == torch.float32 and conversion.dtype != torch.float32:
        return torch.float32  # kept in fp32 by the model (moe_router_dtype, expert bias)
    return conversion.dtype


class _MergedPieces:
    """This rank's pieces with their parameter's LoRA update added: ``W + delta`` in float32 per
    shard, cast back to the piece's dtype (what ``iter_hf_weights(merge_lora=True)`` gathers).

    A piece is a row range of one parameter (megatron's sharded tensors and factories cut
    weights by rows); parameters may be views into one buffer (megatron's DDP), so the owner is
    found by address, not by storage.
    """

    def __init__(self, local: dict, params) -> None:
        self.local = local
        owners = sorted(
            (p.data_ptr(), p) for p in params if hasattr(p, LORA_DELTA) and p.numel() > 0
        )
        self.starts = [start for start, _ in owners]
        self.owners = [p for _, p in owners]
        self.count = len(owners)
        self._last: tuple = (None, None)

    def _owner(self, data: torch.Tensor):
        i = bisect.bisect_right(self.starts, data.data_ptr()) - 1
        if i < 0:
            return None
        owner = self.owners[i]
        end = owner.data_ptr() + owner.numel() * owner.element_size()
        return owner if data.data_ptr() < end else None

    def __getitem__(self, k) -> torch.Tensor:
        data = self.local[k]
        owner = self._owner(data) if data.numel() else None
        if owner is None:
            return data
        offset, row_size = data.data_ptr() - owner.data_ptr(), owner.stride(0) * data.element_size()
        if (
            data.shape[1:] != owner.shape[1:]
            or data.stride() != owner.stride()
            or offset % row_size
        ):  # megatron's factories slice rows only
            raise AssertionError(f"{k}: a piece that is not a row range of its parameter")
        if self._last[0] is not owner:
            self._last = (owner, getattr(owner, LORA_DELTA)())
        row = offset // row_size
        delta = self._last[1][row : row + data.shape[0]].to(data.device)
        return (data.float() + delta).to(data.dtype)


@dataclass
class _ExportState:
    """What one model needs for every export: its pieces, the plan, cached index tensors."""

    plan: Plan
    key_shapes: dict
    pieces: dict
    local: dict
    params: list
    ptrs: list
    indices: dict
    views: dict = field(default_factory=dict)
    device_scales: dict = field(default_factory=dict)
    specs: dict = field(default_factory=dict)

    def valid(self) -> bool:
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.ptrs, strict=True))


def _export_state(chunks, conversion, group, world: bool, rank: int) -> _ExportState:
    """The export state of ``chunks``, built once and reused while the parameters stay put
    (repeated RL weight syncs skip the sharded-state-dict walk and the all-gather)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    cached = getattr(chunks[0], "_hf_export_state", None)
    if cached is not None and cached[0] is conversion and cached[1].valid():
        return cached[1]
    local: dict[tuple, torch.Tensor] = {}
    meta: list[ShardBox] = []
    key_shapes: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        sharded, _ = sharded_tensors(chunk)
        for st in sharded_leaves(sharded):
            if not isinstance(st, ShardedTensor):
                continue
            key_shapes[st.key] = tuple(st.global_shape)
            expert = expert_index(st)
            offset = tuple(st.global_offset[st.prepend_axis_num :])
            if (st.key, expert, offset) in local or not is_main_replica(st.replica_id):
                continue
            local[(st.key, expert, offset)] = st.data
            meta.append(
                ShardBox(st.key, expert, offset, tuple(st.local_shape), st.data.dtype, rank)
            )
    if world:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (meta, key_shapes), group=group)
    else:
        gathered = [(meta, key_shapes)]
    pieces: dict[tuple[str, int | None], dict[tuple, ShardBox]] = {}
    key_shapes = {}
    for rank_meta, rank_shapes in gathered:
        key_shapes.update(rank_shapes)
        for piece in rank_meta:  # lowest rank wins among replicas
            pieces.setdefault((piece.key, piece.expert), {}).setdefault(piece.offset, piece)
    plan, unresolved = build_plan(conversion, key_shapes)
    report = check_plan(plan, unresolved, None)
    if report.unmapped_model or report.shape_errors:
        raise HFWeightsError("the model does not fit the conversion:\n" + "\n".join(report.lines()))
    params = [p for chunk in chunks for p in chunk.parameters()]
    state = _ExportState(
        plan, key_shapes, pieces, local, params, [p.data_ptr() for p in params], {}
    )
    for chunk in chunks:
        chunk._hf_export_state = (conversion, state)
    return state


def iter_hf_weights(
    model,
    *,
    quantize: str = "source",
    conversion: HFConversion | None = None,
    dtype: torch.dtype | None = None,
    group=None,
    device=None,
    bucket_size: int | str = "256MB",
    merge_lora: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` in the on-disk Hugging Face names and layouts.

    Call it on every rank of ``group`` (default: the world) at the same time: tensors are
    assembled from the shards of all TP / expert-TP / EP / PP / DP ranks one Hugging Face tensor
    at a time (broadcast from the rank that holds each piece), and every rank receives every
    tensor. Memory beyond the model is one Hugging Face tensor plus the checkpoint tensors it is
    cut from. Where a tensor is a plain slice of one parameter on this rank (one rank, no
    reordering) it is yielded as a view, without a copy: copy it if you keep it across an
    optimizer step. The plan is built on the first call and reused while the parameters stay
    where they are.

    FP8 (``quantize``): a weight to be FP8 is quantized after it is gathered (a block may span
    shards), on ``device``, and yielded as ``name`` (``float8_e4m3fn``) followed by
    ``name + "_scale_inv"`` (one scale per block); consecutive weights are quantized a bucket at
    a time (``bucket_size`` bounds the memory that takes; :mod:`megatron_hybrid.hf.fp8_stream`).

    Args:
        model: a HybridModel or a list of (wrapped) model chunks built by this package.
        quantize: ``"source"``: the weights the model was loaded from FP8 are FP8 again, with
            the source's blocks and scale dtype, a block keeping its source scale while its
            values are still FP8 multiples of it (an unchanged model streams back its
            source bytes); ``"fp8"``: the family's FP8 release recipe (128 x 128 blocks,
            ``s = amax / 448``, the modules the release keeps unquantized left so) for any
            model; ``"none"``: no FP8 (weights loaded from FP8 in the parameters' dtype).
        conversion: the :class:`HFConversion` (default: the one ``load_hf_model`` attached).
        dtype: output dtype of unquantized tensors (default: each tensor's dtype in the source
            checkpoint, else the config's; router expert biases stay float32 always).
        group: process group spanning all ranks that hold the model (default: the world).
        device: where tensors are assembled and yielded (default: the current CUDA device, or
            CPU without CUDA).
        bucket_size: most memory FP8 quantization holds at once, e.g. ``"256MB"``.
        merge_lora: for a model with LoRA adapters, which weights to stream; it must be
            said (None, the default, raises for such a model: a sync that silently sends the
            base of a fine-tuned policy is the failure RL users report). True: the weights
            with their adapters merged, ``W + (alpha / rank) B A``, computed in float32 on
            each rank's shard before anything is gathered, then cast to the usual dtype (or
            quantized: merged per shard, gathered, then quantized); same names, dtypes and
            order as without, tensors without an adapter bitwise the same; raises if no weight
            has an adapter. False: the base weights alone (the adapters go separately, through
            ``megatron_hybrid.peft.iter_lora_weights``). A model without adapters streams its
            weights with None or False.

    Raises:
        ValueError: an unknown ``quantize``; ``UnsupportedQuantizationError`` (a ValueError):
            ``quantize="fp8"`` for a family without an FP8 release recipe; ``HFWeightsError``
            (a ValueError): adapters and ``merge_lora=None``, or no adapter and
            ``merge_lora=True``.
    """
    import torch.distributed as dist

    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r}: choose one of {', '.join(QUANTIZE_MODES)}")
    chunks = model_chunks(model)
    conversion = conversion or getattr(chunks[0], "hf_conversion", None)
    if conversion is None:
        raise HFWeightsError(
            "iter_hf_weights needs the model's HFConversion: pass conversion=... (from "
            "megatron_hybrid.hf.conversion_for) or build the model with load_hf_model"
        )
    source_dtypes = getattr(chunks[0], "hf_source_dtypes", None)
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    world = dist.is_initialized() and dist.get_world_size(group) > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = _export_state(chunks, conversion, group, world, rank)
    plan, key_shapes, pieces, local = state.plan, state.key_shapes, state.pieces, state.local
    if quantize not in state.specs:  # one regex pass over the names per mode, not per call
        state.specs[quantize] = fp8_specs(plan, quantize, conversion, source_dtypes or {})
    specs = state.specs[quantize]
    quantizer = BucketQuantizer(parse_size(bucket_size)) if specs else None
    scales = getattr(chunks[0], "hf_fp8_scales", None) or {}
    where = str(device)
    # Parameter slices found once are reused by later calls; merged pieces are new tensors
    # each call, so a merging stream neither reads nor fills that cache.
    views = {} if merge_lora else state.views
    if merge_lora is not False:
        merged = _MergedPieces(local, state.params)
        adapted = torch.tensor([merged.count], dtype=torch.float64, device=device)
        if world:  # pipeline stages differ: every rank must reach the same verdict
            dist.all_reduce(adapted, group=group)
        if merge_lora and not adapted.item():
            raise HFWeightsError(
                "merge_lora=True, but no weight of the model has a LoRA adapter: apply one "
                "first (megatron_hybrid.peft.apply_lora or load_peft_adapter)"
            )
        if merge_lora is None and adapted.item():
            raise HFWeightsError(
                f"the model has LoRA adapters ({int(adapted.item())} adapted weights): say "
                "which weights to stream, merge_lora=True for the weights with the adapters "
                "merged in (what the model computes) or merge_lora=False for the base weights "
                "alone (with the adapters sent apart, megatron_hybrid.peft.iter_lora_weights)"
            )
        if merge_lora:
            local = merged

    def assemble(key: str, expert: int | None) -> tuple[torch.Tensor, torch.dtype]:
        shape = key_shapes[key][1:] if expert is not None else key_shapes[key]
        parts = pieces[(key, expert)]
        only = next(iter(parts.values()))
        if not world and len(parts) == 1 and only.shape == tuple(shape):
            return local[(key, expert, only.offset)].to(device), only.dtype
        out = torch.empty(shape, dtype=only.dtype, device=device)
        for offset, piece in parts.items():
            box = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape, strict=True))
            if world:
                if piece.rank == rank:
                    buf = local[(key, expert, offset)].to(device).contiguous()
                else:
                    buf = torch.empty(piece.shape, dtype=piece.dtype, device=device)
                dist.broadcast(buf, src=piece.rank, group=group)
            else:
                buf = local[(key, expert, offset)]
            out[box] = buf
        return out, only.dtype

    def local_rows(link: Link):
        """``(rows, dtype, whether they are a view of the parameter)`` of the link from one
        local piece, or None (world > 1, or split)."""
        if world:
            return None
        shape = key_shapes[link.key][1:] if link.expert is not None else key_shapes[link.key]
        for offset, piece in pieces[(link.key, link.expert)].items():
            start = offset[0]
            if (
                start <= link.key_rows.start
                and link.key_rows.stop <= start + piece.shape[0]
                and tuple(piece.shape[1:]) == tuple(shape[1:])
            ):
                data = local[(link.key, link.expert, offset)]
                moved = data.to(device)
                # detach(): a view kept across calls must not carry autograd's view record,
                # which refuses any use in grad mode once an optimizer step changed the base.
                rows = moved.detach()[link.key_rows.start - start : link.key_rows.stop - start]
                return rows, piece.dtype, moved is data
        return None

    cache: dict[tuple[str, int | None], tuple[torch.Tensor, torch.dtype]] = {}
    produced: dict[str, torch.Tensor] = {}
    copies_of = set(plan.shared_copies.values())

    def rows_of(link: Link):
        found = local_rows(link)
        if found is not None:
            return found[:2]
        k = (link.key, link.expert)
        if k not in cache:
            cache[k] = assemble(*k)
        full, piece_dtype = cache[k]
        return full[link.key_rows], piece_dtype

    def index_of(link: Link, device) -> torch.Tensor:
        k = (id(link), str(device))
        if k not in state.indices:
            state.indices[k] = torch.tensor(link.hf_rows, device=device)
        return state.indices[k]

    def source_scales(name: str, spec: FP8Spec) -> torch.Tensor | None:
        scale = scales.get(name + SCALE_SUFFIX) if spec.keep_source_scales else None
        if scale is None:
            return None
        k = (name, where)
        if k not in state.device_scales:
            state.device_scales[k] = scale.to(device)
        return state.device_scales[k]

    def make(name: str, quantized: bool = False) -> torch.Tensor:
        view = views.get((name, where))
        if view is not None:
            # A slice of a parameter found on an earlier call (of the detached parameter: no
            # grad-mode switch needed; most tensors of a sync come this way).
            return finish(name, *view, quantized)
        with torch.no_grad():
            return build(name, quantized)

    def build(name: str, quantized: bool) -> torch.Tensor:
        if name in plan.shared_copies:
            return produced.pop(plan.shared_copies[name]).clone()
        links = plan.by_hf[name]
        needed = {(link.key, link.expert) for link in links}
        for stale in set(cache) - needed:
            del cache[stale]
        if world:  # the same collectives in the same order on every rank
            for k in sorted(needed, key=str):
                if k not in cache:
                    cache[k] = assemble(*k)
        shape = plan.hf_shapes[name]
        first = links[0]
        if (
            len(links) == 1
            and isinstance(first.hf_rows, slice)
            and first.hf_rows.stop - first.hf_rows.start == shape[0]
        ):
            found = local_rows(first)
            if found is None:
                tensor, piece_dtype = rows_of(first)
            else:
                tensor, piece_dtype, is_view = found
                if is_view:
                    views[(name, where)] = (tensor, piece_dtype)
        else:
            values = [rows_of(link) for link in links]
            piece_dtype = values[0][1]
            tensor = torch.empty(shape, dtype=values[0][0].dtype, device=values[0][0].device)
            for link, (value, _) in zip(links, values, strict=True):
                if isinstance(link.hf_rows, slice):
                    tensor[link.hf_rows] = value
                else:
                    tensor.index_copy_(0, index_of(link, tensor.device), value)
        return finish(name, tensor, piece_dtype, quantized)

    def finish(name: str, tensor, piece_dtype, quantized: bool) -> torch.Tensor:
        if not quantized:  # a weight to be FP8 goes to the quantizer in the parameters' dtype
            target = _target_dtype(name, plan, conversion, dtype, source_dtypes, piece_dtype)
            tensor = tensor.to(target)
        if name in copies_of:
            produced[name] = tensor
        return tensor

    for name in plan.hf_names():
        spec = specs.get(name)
        if spec is None:
            if quantizer is not None:
                yield from quantizer.flush()
            yield name, make(name)
        else:
            tensor = make(name, quantized=True)
            yield from quantizer.add(name, tensor, spec, source_scales(name, spec))
    if quantizer is not None:
        yield from quantizer.flush()

"""Weights in and out: ``load_hf_weights`` and the streaming ``iter_hf_weights``.

Both walk the model's *sharded* state dict (``docs/checkpoints.md``): for every tensor a rank
holds, megatron-core says which box of which global checkpoint tensor it is, fused TP layouts
(SwiGLU halves, GatedDeltaNet's in_proj pieces) and expert placement included. Loading fills
each box from the Hugging Face rows the :class:`~megatron_hybrid.hf.plan.Plan` names, reading
only those rows (a rank reads its experts, its layers and, for contiguous layouts, its slice).
Exporting assembles one Hugging Face tensor at a time from the boxes of all ranks: no rank ever
holds more than the tensor being yielded and the checkpoint tensors it is cut from.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from megatron_hybrid.hf.config import HFConversion, conversion_for, family_named
from megatron_hybrid.hf.fp8 import FP8_DTYPE, SCALE_SUFFIX, DequantizingReader
from megatron_hybrid.hf.fp8_stream import BucketQuantizer, FP8Spec, fp8_specs
from megatron_hybrid.hf.io import HFCheckpoint, HFTensors, parse_size, require_finite, side_files
from megatron_hybrid.hf.plan import EXPERT_KEY_MARK, Link, Plan, build_plan, check_plan

__all__ = [
    "LORA_DELTA",
    "QUANTIZE_MODES",
    "HFWeightsError",
    "carried_names",
    "iter_hf_weights",
    "load_hf_weights",
]

#: ``quantize=`` of :func:`iter_hf_weights`: as loaded, the family's FP8 recipe, unquantized.
QUANTIZE_MODES = ("source", "fp8", "none")

#: Name of the attribute through which a parameter takes part in merged exports: a parameter
#: that has it is exported by ``iter_hf_weights(merge_lora=True)`` as ``param + delta`` where
#: ``delta = getattr(param, LORA_DELTA)()`` is the float32 low-rank update of this rank's shard,
#: shaped like the parameter (``megatron_hybrid.peft`` sets it on every adapted weight).
LORA_DELTA = "lora_delta"

#: Sharded-state-dict metadata used for conversion: always the indexed (per-layer) key form,
#: so that a key names one layer whatever the pattern.
SHARDED_METADATA = {"non_homogeneous_layers": True}


class HFWeightsError(ValueError):
    """Hugging Face weights that do not fit the model."""


def model_chunks(model) -> list:
    """The unwrapped model chunks (DDP / Float16Module wrappers removed)."""
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, list | tuple) else [model]
    return unwrap_model(list(chunks))


def _sharded_tensors(chunk):
    """``(sharded dict, factories)`` of a chunk with factories applied (ShardedTensors only)."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories

    sharded = chunk.sharded_state_dict(metadata=dict(SHARDED_METADATA))
    factories, _ = extract_matching_values(sharded, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(sharded)
    return sharded, factories


def _leaves(x):
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(x))


def _expert(st) -> int | None:
    if EXPERT_KEY_MARK in st.key:
        if st.prepend_axis_num != 1:  # internal invariant of megatron's SequentialMLP form
            raise AssertionError(f"{st.key}: expected one expert axis")
        return int(st.global_offset[0])
    if st.prepend_axis_num:
        raise AssertionError(f"{st.key}: unexpected leading axes {st.prepend_axis_num}")
    return None


def _read_rows(source: HFCheckpoint, name: str, rows, rest: tuple[slice, ...]) -> torch.Tensor:
    if isinstance(rows, slice):
        values = source.read(name, (rows, *rest))
    else:
        low, high = min(rows), max(rows) + 1
        span = source.read(name, (slice(low, high), *rest))
        values = span[torch.tensor([r - low for r in rows])]
    return require_finite(source, name, values)


def _fill_box(st, plan: Plan, source: HFCheckpoint) -> torch.Tensor:
    """The Hugging Face values of the box a ShardedTensor stands for."""
    expert = _expert(st)
    axis = st.prepend_axis_num
    start = st.global_offset[axis]
    size = st.local_shape[0]
    rest = tuple(
        slice(o, o + n)
        for o, n in zip(st.global_offset[axis + 1 :], st.local_shape[1:], strict=True)
    )
    out = torch.empty(st.local_shape, dtype=st.data.dtype)
    covered = 0
    for link in plan.by_key.get((st.key, expert), ()):
        low = max(start, link.key_rows.start)
        high = min(start + size, link.key_rows.stop)
        if low >= high:
            continue
        i0, i1 = low - link.key_rows.start, high - link.key_rows.start
        if isinstance(link.hf_rows, slice):
            rows = slice(link.hf_rows.start + i0, link.hf_rows.start + i1)
        else:
            rows = link.hf_rows[i0:i1]
        out[low - start : high - start] = _read_rows(source, link.hf_name, rows, rest)
        covered += high - low
    if covered != size:
        label = st.key if expert is None else f"{st.key} [expert {expert}]"
        raise HFWeightsError(f"no Hugging Face source for {size - covered} rows of {label}")
    return out


def carried_names(source, conversion: HFConversion) -> list[str]:
    """The folder's tensors under the parts its config declares but the model does not compute
    (a multimodal Qwen3.5's vision tower): carried through untouched."""
    prefixes = family_named(conversion.family).carried_prefixes(conversion.config_json)
    carried = [name for name in source.names() if prefixes and name.startswith(prefixes)]
    if carried:
        # Carried FP8 weights are written dequantized by quantize="none" / "fp8": their layout
        # (scale present, of the right shape, a quantization_config) is checked as the model's.
        keep = set(carried)
        DequantizingReader(
            source, conversion.quantization, skip=[n for n in source.names() if n not in keep]
        )
    return carried


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def load_hf_weights(
    model, path, conversion: HFConversion | None = None, *, progress=None, plan: Plan | None = None
):
    """Load a Hugging Face checkpoint into ``model`` (its chunks on this rank), strictly.

    Each rank reads only the Hugging Face rows behind its own shards. Block-scaled FP8 weights
    (``conversion.quantization``) are dequantized on the way, ``q.float() * s`` block by block,
    and cast to the parameters' dtype; each rank reads the FP8 bytes and scales of its own
    blocks only. The model keeps what export needs to write the source format again: each
    tensor's stored dtype (``hf_source_dtypes``), the FP8 scales (``hf_fp8_scales``), and on
    global rank 0 the tensors of declared parts it does not compute (``hf_carried``: a
    multimodal checkpoint's vision tower); and where it came from (``hf_source_path``, absolute)
    with the files serving needs beside the weights (``hf_side_files``: tokenizer, generation
    config, chat template), which checkpoints carry and exports write.

    Args:
        model: a HybridModel, a list of model chunks, or wrapped ones (DDP, Float16Module).
        path: the Hugging Face folder (or an open :class:`HFCheckpoint`), or a mapping of
            Hugging Face names to tensors (an ``iter_hf_weights`` stream collected with
            ``dict``: weight sync into another model built from the same folder).
        conversion: the :class:`HFConversion` the model was built from (default: from the
            folder's config.json; for a mapping, the one ``load_hf_model`` attached).
        progress: optional callable ``(done, total)`` called after each tensor.
        plan: the conversion's weight plan over the whole model (``check_conversion`` made
            it); default: planned here from this rank's keys.

    Raises:
        HFWeightsError: a model tensor has no source, or shapes do not fit.
        HFCheckpointError: a value read is NaN or infinite (named with its file).
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges

    if isinstance(path, Mapping):
        conversion = conversion or getattr(model_chunks(model)[0], "hf_conversion", None)
        if conversion is None:
            raise HFWeightsError(
                "load_hf_weights of tensors in memory needs conversion=... for a model not "
                "built by load_hf_model"
            )
        folder = HFTensors(path, conversion.config_json)
    else:
        folder = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    conversion = conversion or conversion_for(folder)
    carried = carried_names(folder, conversion)
    source = DequantizingReader(folder, conversion.quantization, skip=carried)
    chunks = model_chunks(model)
    states = [_sharded_tensors(chunk) for chunk in chunks]
    key_shapes = {
        st.key: tuple(st.global_shape)
        for sharded, _ in states
        for st in _leaves(sharded)
        if isinstance(st, ShardedTensor)
    }
    if plan is None:
        plan, _ = build_plan(conversion, key_shapes)
    info = {name: source.info(name) for name in plan.hf_shapes if name in source}
    for name, shape in plan.hf_shapes.items():
        if name in plan.shared_copies:
            continue
        if name not in info:
            raise HFWeightsError(f"{source.path} has no tensor {name!r}, which the model needs")
        if tuple(info[name][1]) != shape:
            raise HFWeightsError(
                f"{source.path}: {name} has shape {tuple(info[name][1])}, the model needs {shape}"
            )
    for name, original in plan.shared_copies.items():
        # Stored copies of a shared tensor (DeepSeek's MTP embedding and head) must be copies:
        # the model holds one tensor for both.
        if (
            name in source
            and original in source
            and not torch.equal(source.get(name), source.get(original))
        ):
            raise HFWeightsError(
                f"{source.path}: {name} differs from {original}, which the model shares it with; "
                "megatron's MTP uses the main embedding and output layer"
            )
    total = sum(
        1 for sharded, _ in states for st in _leaves(sharded) if isinstance(st, ShardedTensor)
    )
    done = 0

    def fill(x):
        nonlocal done
        if not isinstance(x, ShardedTensor):
            return x
        value = _fill_box(x, plan, source)
        done += 1
        if progress is not None:
            progress(done, total)
        return value

    with torch.no_grad():
        for chunk, (sharded, factories) in zip(chunks, states, strict=True):
            loaded = apply_factory_merges(dict_list_map_outplace(fill, sharded), factories)
            current = chunk.state_dict()
            state = {}
            for name, value in current.items():
                new = loaded.get(name)
                if isinstance(new, torch.Tensor):
                    state[name] = new.to(device=value.device)
                elif name.endswith("_extra_state"):
                    state[name] = value
                else:
                    raise HFWeightsError(f"model tensor {name} has no Hugging Face source")
            chunk.load_state_dict(state, strict=True)
    dtypes = {name: source.info(name)[0] for name in source.names()}
    dtypes.update({scale: folder.info(scale)[0] for scale in source.scales.values()})
    scales = source.scale_tensors()
    kept = {name: folder.get(name) for name in carried} if _global_rank() == 0 else {}
    for chunk in chunks:
        chunk.hf_source_dtypes = dtypes
        chunk.hf_fp8_scales = scales
        chunk.hf_carried = kept
        chunk.hf_conversion = conversion
        if not isinstance(folder, HFTensors):  # weights synced from memory keep their source
            chunk.hf_source_path = os.path.abspath(folder.path)
            chunk.hf_side_files = side_files(folder.path)  # tokenizer etc., for exports
    return model


@dataclass(frozen=True)
class _Piece:
    key: str
    expert: int | None
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    rank: int


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
    meta: list[_Piece] = []
    key_shapes: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        sharded, _ = _sharded_tensors(chunk)
        for st in _leaves(sharded):
            if not isinstance(st, ShardedTensor):
                continue
            key_shapes[st.key] = tuple(st.global_shape)
            expert = _expert(st)
            offset = tuple(st.global_offset[st.prepend_axis_num :])
            if (st.key, expert, offset) in local or not is_main_replica(st.replica_id):
                continue
            local[(st.key, expert, offset)] = st.data
            meta.append(_Piece(st.key, expert, offset, tuple(st.local_shape), st.data.dtype, rank))
    if world:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (meta, key_shapes), group=group)
    else:
        gathered = [(meta, key_shapes)]
    pieces: dict[tuple[str, int | None], dict[tuple, _Piece]] = {}
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

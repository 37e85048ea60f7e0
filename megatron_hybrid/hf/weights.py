"""Weights in: ``load_hf_weights`` (out: ``iter_hf_weights`` in :mod:`megatron_hybrid.hf.stream`).

Both walk the model's *sharded* state dict (``docs/checkpoints.md``): for every tensor a rank
holds, megatron-core says which box of which global checkpoint tensor it is, fused TP layouts
(SwiGLU halves, GatedDeltaNet's in_proj pieces) and expert placement included. Loading fills
each box from the Hugging Face rows the :class:`~megatron_hybrid.hf.plan.Plan` names, reading
only those rows (a rank reads its experts, its layers and, for contiguous layouts, its slice).
Exporting assembles one Hugging Face tensor at a time from the boxes of all ranks: no rank ever
holds more than the tensor being yielded and the checkpoint tensors it is cut from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_hybrid.hf.config import HFConversion, conversion_for, family_named
from megatron_hybrid.hf.fp8 import DequantizingReader
from megatron_hybrid.hf.io import HFCheckpoint, HFTensors, require_finite, side_files
from megatron_hybrid.hf.plan import EXPERT_KEY_MARK, Plan, build_plan

__all__ = [
    "LORA_DELTA",
    "QUANTIZE_MODES",
    "HFWeightsError",
    "ShardBox",
    "carried_names",
    "expert_index",
    "load_hf_weights",
    "model_chunks",
    "sharded_leaves",
    "sharded_tensors",
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


@dataclass(frozen=True)
class ShardBox:
    """Where one rank's box of a checkpoint tensor lies (what ranks exchange before gathering
    a Hugging Face tensor from boxes): its sharded key, global expert (or None), offset and
    shape in the global tensor, dtype, and the rank that holds it."""

    key: str
    expert: int | None
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    rank: int


def model_chunks(model) -> list:
    """The unwrapped model chunks (DDP / Float16Module wrappers removed)."""
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, list | tuple) else [model]
    return unwrap_model(list(chunks))


def sharded_tensors(chunk):
    """``(sharded dict, factories)`` of a chunk with factories applied (ShardedTensors only)."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories

    sharded = chunk.sharded_state_dict(metadata=dict(SHARDED_METADATA))
    factories, _ = extract_matching_values(sharded, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(sharded)
    return sharded, factories


def sharded_leaves(x):
    """The leaves (sharded tensors) of a nested sharded state dict, in order."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(x))


def expert_index(st) -> int | None:
    """The global expert a sharded tensor of ``SequentialMLP``'s form belongs to, or None."""
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
    expert = expert_index(st)
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
    states = [sharded_tensors(chunk) for chunk in chunks]
    key_shapes = {
        st.key: tuple(st.global_shape)
        for sharded, _ in states
        for st in sharded_leaves(sharded)
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
        1
        for sharded, _ in states
        for st in sharded_leaves(sharded)
        if isinstance(st, ShardedTensor)
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

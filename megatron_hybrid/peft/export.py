"""Adapters out: ``iter_lora_weights``, ``save_peft_adapter`` and the matching config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.outputs import Output
from megatron_hybrid.peft.adapter_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatron_hybrid.peft.apply import lora_state
from megatron_hybrid.peft.config import LoRAConfigError
from megatron_hybrid.peft.formats import config_targets, pack_experts
from megatron_hybrid.peft.gather import AdapterRecord, AdapterTensors, adapter_tensors
from megatron_hybrid.peft.layout import lora_key
from megatron_hybrid.peft.naming import Naming

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "iter_lora_weights",
    "lora_config_dict",
    "save_peft_adapter",
]


def naming_of(model, format: str) -> Naming:
    """The :class:`Naming` of an adapted model converted from Hugging Face."""
    state = lora_state(model)
    if state is None:
        raise LoRAConfigError("the model has no LoRA adapters (apply_lora or load_peft_adapter)")
    if state.conversion is None:
        raise LoRAConfigError(
            "the model has no Hugging Face conversion, so its adapters have no Hugging Face "
            "names: build it with load_hf_model, or pass conversion= to apply_lora"
        )
    return Naming(state.conversion, state.plan, format)


@dataclass
class _Item:
    """One module piece, or one routed-expert parameter of one layer (all its experts)."""

    position: int
    record: AdapterRecord | None = None
    piece: str = ""
    experts: dict[int, AdapterRecord] = field(default_factory=dict)


def _check(records, naming: Naming) -> None:
    for rec in records:
        if rec.path.startswith("mtp."):
            raise LoRAConfigError(
                f"{rec.path} (an MTP layer) has an adapter, but transformers has no MTP modules "
                "and PEFT would drop it; export the merged weights (merge_lora=True), or train "
                "without MTP adapters (only targets that name mtp.* adapt MTP layers)"
            )
        reason = naming.peft.refused.get((rec.symbol, rec.name))
        if reason:
            raise LoRAConfigError(f"{rec.path}: {reason}")


def _items(records, naming: Naming) -> list[_Item]:
    items: dict = {}
    for rec in records:
        if rec.fused is None:
            for piece in rec.pieces:
                position = naming.position[f"{piece}.weight"]
                items[("module", piece)] = _Item(position, rec, piece)
            continue
        key = ("experts", rec.fused.key)
        if key not in items:
            first = min(naming.position[link.hf_name] for link in naming.expert_links(rec.fused, 0))
            items[key] = _Item(first)
        items[key].experts[rec.expert] = rec
    return sorted(items.values(), key=lambda item: item.position)


def _b_rows(rows: int, links, full, rank: int, like: torch.Tensor) -> torch.Tensor:
    """``B`` of one Hugging Face tensor (``rows`` rows): the plan's rows of the ``B`` of the
    checkpoint keys it is cut from."""
    out = torch.empty(rows, rank, dtype=like.dtype, device=like.device)
    for link in links:
        value = full(lora_key(link.key, "B"), link.expert)[link.key_rows]
        if isinstance(link.hf_rows, slice):
            out[link.hf_rows] = value
        else:
            out[torch.tensor(link.hf_rows, device=like.device)] = value
    return out


def _stream(model, format: str, dtype, group, device) -> Iterator[tuple[str, torch.Tensor]]:
    naming = naming_of(model, format)
    tensors: AdapterTensors = adapter_tensors(model, group)
    records = list(tensors.records.values())
    _check(records, naming)
    plan = naming.plan
    fused_params = {
        module: [f.param for f in params] for module, params in naming.fused_modules().items()
    }
    adapted_params: dict[str, set[str]] = {}
    for rec in records:
        if rec.fused is not None:
            adapted_params.setdefault(rec.fused.module, set()).add(rec.fused.param)
    cache: dict = {}

    def full(key, expert):
        if (key, expert) not in cache:
            cache[(key, expert)] = tensors.full(key, expert, device)
        return cache[(key, expert)]

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if dtype is None else t.to(dtype)

    for item in _items(records, naming):
        cache.clear()
        if item.record is not None:
            rec, rank = item.record, item.record.rank
            a_full = full(rec.a_key, rec.expert)
            block = rec.block(item.piece)
            name_a, name_b = naming.module(item.piece)
            name = f"{item.piece}.weight"
            b = _b_rows(plan.hf_shapes[name][0], plan.by_hf[name], full, rank, a_full)
            yield name_a, cast(a_full[block * rank : (block + 1) * rank])
            yield name_b, cast(b)
            continue
        rec = next(iter(item.experts.values()))
        fused, rank = rec.fused, rec.rank
        count = plan.key_shapes[fused.key][0]
        b_key = lora_key(fused.key, "B")
        a_list, b_list = [], []
        for e in range(count):
            if e in item.experts:
                a_list.append(full(item.experts[e].a_key, e))
                b_list.append(full(b_key, e))
            else:  # an expert left out: PEFT's 3-D adapter covers all, so zeros (no effect)
                out, width = plan.key_shapes[fused.key][1:]
                like = a_list[0] if a_list else full(rec.a_key, rec.expert)
                a_list.append(torch.zeros(rank, width, dtype=like.dtype, device=like.device))
                b_list.append(torch.zeros(out, rank, dtype=like.dtype, device=like.device))
        if format == "peft":
            adapted = [p for p in fused_params[fused.module] if p in adapted_params[fused.module]]
            name_a, name_b = naming.experts(fused, adapted)
            a, b = pack_experts(a_list, b_list)
            yield name_a, cast(a)
            yield name_b, cast(b)
            continue
        for e in range(count):
            links = naming.expert_links(fused, e)
            names = list(dict.fromkeys(link.hf_name for link in links))
            for name in names:
                mine = [link for link in links if link.hf_name == name]
                rows = torch.cat([b_list[e][link.key_rows] for link in mine])
                name_a, name_b = naming.module(name.removesuffix(".weight"))
                yield name_a, cast(a_list[e])
                yield name_b, cast(rows)


def iter_lora_weights(
    model, *, format: str = "peft", dtype: torch.dtype | None = None, group=None, device=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the adapter as ``(name, tensor)``, exactly as :func:`save_peft_adapter` writes it.

    Call it on every rank of ``group`` (default: the world) together: adapter tensors are
    gathered over TP / EP / PP like ``iter_hf_weights`` gathers weights, and every rank gets
    every tensor. Names are PEFT's on-disk names (``base_model.model.<module>.lora_A.weight``);
    :func:`lora_config_dict` is the matching ``adapter_config.json``.

    Args:
        model: the adapted model (this rank's chunks).
        format: ``"peft"`` (routed experts as PEFT's 3-D ``target_parameters`` layout) or
            ``"per_expert"`` (routed experts as ``experts.{e}.gate_proj`` etc.).
        dtype: output dtype (default: the adapters').
        group: process group over every rank holding the model.
        device: where tensors are assembled (default: the current CUDA device, or CPU).

    Raises:
        LoRAConfigError: an adapter PEFT cannot hold (Mamba ``out_proj`` of Nemotron-H, MTP
            layers), or a model without a Hugging Face conversion.
    """
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    yield from _stream(model, format, dtype, group, device)


def lora_config_dict(
    model, *, format: str = "peft", base_model_name_or_path: str | None = None, group=None
) -> dict:
    """The ``adapter_config.json`` of the adapter :func:`iter_lora_weights` yields (every rank).

    ``target_modules`` and ``target_parameters`` name what is adapted: a leaf (``q_proj``)
    where every such module of the base is adapted, full names otherwise; for Qwen3-Next and
    DeepSeek-V3 the dense and shared MLPs as 2-D ``target_parameters`` (see
    :class:`~megatron_hybrid.peft.formats.PeftFamily`). ``lora_dropout`` is 0 (PEFT refuses
    dropout with ``target_parameters``; inference uses none).
    """
    naming = naming_of(model, format)
    state = lora_state(model)
    records = list(adapter_tensors(model, group).records.values())
    _check(records, naming)
    modules, parameters = [], []
    for rec in records:
        if rec.fused is None:
            for piece in rec.pieces:
                key = naming.plan.by_hf[f"{piece}.weight"][0].key
                entry = naming.piece_entry(piece, key)
                (parameters if entry[1].endswith(".weight") else modules).append(entry)
        elif format == "peft":
            parameters.append(naming.fused_entry(rec.fused))
        else:
            for link in naming.expert_links(rec.fused, rec.expert):
                modules.append(naming.piece_entry(link.hf_name.removesuffix(".weight"), link.key))
    instances = naming.instances()
    config = state.config
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "use_rslora": config.use_rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": config_targets(modules, instances),
        "target_parameters": config_targets(parameters, instances) or None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }


def save_peft_adapter(
    model,
    out,
    *,
    format: str = "peft",
    dtype: torch.dtype | None = None,
    base_model_name_or_path: str | None = None,
    group=None,
    overwrite: bool = False,
    sources=None,
) -> Path | None:
    """Write the adapter as a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads on the transformers
    model. Collective over ``group``; rank 0 writes, beside ``out``, and moves the folder into
    place complete (``checkpointing/outputs.py``): a failure or Ctrl-C leaves ``out`` as it was.

    Args:
        overwrite: replace what ``out`` holds (refused otherwise when it is not empty).
        sources: ``role -> path`` the caller reads; ``out`` may not overlap one (the base is
            always one).

    Returns:
        The folder on rank 0, None elsewhere.
    """
    from safetensors.torch import save_file

    source = base_model_name_or_path
    if source is None:
        state = lora_state(model)
        source = getattr(state, "base_path", None)
    # The base is a source only where it is a folder here: a hub id (``org/model``) names none,
    # so an ``out`` such as ``org/`` overwrites nothing of it (transformers, too, reads a hub id
    # as a local folder only where one exists).
    base = source if source and Path(source).exists() else None
    sources = {"the base": base, **(sources or {})}
    with Output(out, overwrite=overwrite, sources=sources, group=group) as output:
        config = lora_config_dict(model, format=format, base_model_name_or_path=source, group=group)
        tensors = {}
        for name, tensor in iter_lora_weights(model, format=format, dtype=dtype, group=group):
            if output.first:  # own memory: shared-A pieces are views of one tensor
                tensors[name] = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        if output.first:
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
            output.run(save_file, tensors, str(output.path / ADAPTER_WEIGHTS), {"format": "pt"})
            output.run((output.path / ADAPTER_CONFIG).write_text, text)
    return Path(out) if output.first else None

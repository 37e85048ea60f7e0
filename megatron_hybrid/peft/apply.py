"""``apply_lora``, ``disable_lora`` and the adapted model's state."""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_hybrid.hf.plan import build_plan
from megatron_hybrid.hf.weights import LORA_DELTA, SHARDED_METADATA, model_chunks
from megatron_hybrid.peft.adapter import LoRAAdapter, lora_grouped_linear, lora_hook
from megatron_hybrid.peft.config import LoRAConfig, LoRAConfigError
from megatron_hybrid.peft.targets import Candidate, find_candidates, select_pieces

__all__ = [
    "LoRAState",
    "adapters",
    "apply_lora",
    "disable_lora",
    "lora_parameters",
    "lora_state",
    "model_plan",
]


@dataclass
class LoRAState:
    """What ``apply_lora`` attached to a model chunk (``chunk.lora_state``).

    Attributes:
        config: the LoRA configuration.
        adapted: the chunk's adapted linears (their ``module.lora`` is the adapter).
        conversion: the Hugging Face conversion the pieces come from, or None.
        plan: its plan over the whole model's checkpoint keys, or None.
        base_path: the Hugging Face folder the base came from, if known (recorded in PEFT
            folders as ``base_model_name_or_path``).
        base_info: where the base came from and its fingerprint, for adapter checkpoints
            (``train`` sets it; see :mod:`megatron_hybrid.peft.checkpoint`).
    """

    config: LoRAConfig
    adapted: list[Candidate]
    conversion: object = None
    plan: object = None
    base_path: str | None = None
    base_info: dict | None = None


def lora_state(model) -> LoRAState | None:
    """The :class:`LoRAState` of a model (its first chunk), or None without adapters."""
    return getattr(model_chunks(model)[0], "lora_state", None)


def _global_key_shapes(sharded: list[dict], group) -> dict:
    """Checkpoint key -> global shape over every rank's chunks (pipeline stages differ)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shapes = {}
    for state in sharded:
        for value in nested_values(state):
            if isinstance(value, ShardedTensorFactory):
                built = value.build()
                leaves = list(nested_values(built)) if isinstance(built, dict | list) else [built]
            else:
                leaves = [value]
            for st in leaves:
                if isinstance(st, ShardedTensor):
                    shapes[st.key] = tuple(st.global_shape)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        gathered: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, shapes, group=group)
        for other in gathered:
            shapes.update(other)
    return shapes


def model_plan(chunks, conversion, group=None) -> tuple[list[dict], object]:
    """Each chunk's sharded state dict (indexed keys) and the conversion plan over the whole
    model (None without a conversion); collective over ``group``."""
    sharded = [chunk.sharded_state_dict(metadata=dict(SHARDED_METADATA)) for chunk in chunks]
    if conversion is None:
        return sharded, None
    plan, _ = build_plan(conversion, _global_key_shapes(sharded, group))
    return sharded, plan


def _seed(config: LoRAConfig, key: str, expert, piece: str) -> int:
    text = f"{config.init_seed}|{key}|{expert}|{piece}".encode()
    return zlib.crc32(text) | (zlib.adler32(text) << 32)


@torch.no_grad()
def _init_a(adapter: LoRAAdapter, i: int, cand: Candidate, blocks: list[str], config) -> None:
    """PEFT's default ``A`` (kaiming-uniform, bound ``1/sqrt(in)``), drawn per piece from a
    seed of the weight's checkpoint key, so every layout holds the same adapter."""
    weight = cand.weights[i]
    template = weight.chunks[0].template
    p = template.prepend_axis_num
    width, start = template.global_shape[p + 1], template.global_offset[p + 1]
    a = adapter.a(i)
    if a.is_meta:  # a shape-only model (benchmarks, planning): nothing to draw
        return
    local = a.shape[1]
    for block, piece in enumerate(blocks):
        generator = torch.Generator().manual_seed(_seed(config, weight.a_key, weight.expert, piece))
        full = (torch.rand(config.rank, width, generator=generator) * 2 - 1) / math.sqrt(width)
        a[block * config.rank : (block + 1) * config.rank] = full[:, start : start + local]


def _attach(cand: Candidate, config: LoRAConfig) -> None:
    active = sorted(cand.active)
    pieces = [cand.pieces[i] for i in active]
    blocks = ["shared"] if config.shared_a else pieces
    row_piece = cand.weights[0].row_piece
    if any(not torch.equal(w.row_piece, row_piece) for w in cand.weights):
        raise AssertionError(f"{cand.path}: local experts with different row layouts")
    block_of = torch.full((len(cand.pieces),), -1, dtype=torch.long)
    for block, index in enumerate(active):
        block_of[index] = 0 if config.shared_a else block
    row_block = block_of[row_piece]
    onehot = None
    if len(blocks) > 1 or (row_block < 0).any():
        onehot = torch.zeros(row_piece.numel(), len(blocks))
        rows = (row_block >= 0).nonzero().squeeze(1)
        onehot[rows, row_block[rows]] = 1.0
    weight = cand.info.weights[0]
    adapter = LoRAAdapter(
        cand.info,
        rank=config.rank,
        scale=config.scale,
        dropout=config.dropout,
        blocks=len(blocks),
        onehot=onehot,
        in_features=weight.shape[1],
    )
    for i in range(adapter.pairs):
        _init_a(adapter, i, cand, blocks, config)
    cand.module.lora = adapter
    adapter.hook = cand.module.register_forward_hook(lora_hook, with_kwargs=True)
    for i, w in enumerate(cand.info.weights):
        setattr(w, LORA_DELTA, functools.partial(adapter.delta, i))


def _embedding_output_requires_grad(module, args, output):
    """Forward hook on a frozen embedding: its output requires grad, so that schedules which
    run backward from it (megatron's combined 1F1B) and reentrant activation recompute, whose
    recomputed outputs carry gradients only when an input does, reach the adapters (what
    transformers' ``enable_input_require_grads`` does for PEFT)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_()
    return output


def apply_lora(model, config: LoRAConfig, *, conversion=None, group=None):
    """Freeze the base (weights, and routers' expert biases) and add adapters to the linears
    ``config`` selects, on every chunk.

    Call it on every rank (it is collective over ``group``, default the world) on the model
    before it is wrapped for training (megatron's DDP builds its gradient buffers from the
    trainable parameters when it is constructed). ``B`` starts at zero, so the model computes
    the base's outputs bitwise until ``B`` changes.

    Args:
        model: a HybridModel or this rank's list of chunks (Float16Module-wrapped or not).
        config: the :class:`LoRAConfig`.
        conversion: the Hugging Face conversion whose pieces fused weights are cut into
            (default: the one ``load_hf_model`` attached; without one each weight is one piece
            and Hugging Face names are not targets).
        group: the process group over all ranks holding the model.

    Returns:
        ``model``, adapted.

    Raises:
        LoRAConfigError: a target matches nothing, the model already has adapters, or it is
            already wrapped in DistributedDataParallel.
    """
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(config, LoRAConfig):
        raise TypeError(f"apply_lora needs a LoRAConfig, got {type(config).__name__}")
    wrapped = model if isinstance(model, list | tuple) else [model]
    if any(isinstance(m, DistributedDataParallel) for m in wrapped):
        raise LoRAConfigError(
            "apply_lora: the model is already wrapped in DistributedDataParallel, whose "
            "gradient buffers would not hold the adapters; apply LoRA to the bare model "
            "(or its Float16Module) and wrap it afterwards"
        )
    chunks = model_chunks(model)
    if any(getattr(chunk, "lora_state", None) is not None for chunk in chunks):
        raise LoRAConfigError("apply_lora: the model already has LoRA adapters")
    conversion = conversion or getattr(chunks[0], "hf_conversion", None)
    sharded, plan = model_plan(chunks, conversion, group)
    candidates = select_pieces(find_candidates(chunks, sharded, plan), config, group)
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        for module in chunk.modules():
            # An aux-loss-free router's expert bias (DeepSeek-V3's and Nemotron-H's
            # e_score_correction_bias) is a buffer that megatron-core's finalize_model_grads
            # moves after every step (finalize_model_grads.py: _update_router_expert_bias). It
            # belongs to the frozen base: neither adapter checkpoints nor PEFT folders hold it,
            # so a moving bias would route rollouts and resumed runs differently from training.
            if hasattr(module, "expert_bias"):
                module.frozen_expert_bias = True
    for cand in candidates:
        _attach(cand, config)
    for chunk in chunks:
        for module in chunk.modules():
            # Experts that multiply their linears' weights in one grouped GEMM (the package's
            # fast path) expose that seam: the adapters join it there.
            original = getattr(module, "grouped_linear", None)
            if callable(original) and hasattr(module, "local_experts"):
                module.grouped_linear = lora_grouped_linear(module, original)
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            embedding.register_forward_hook(_embedding_output_requires_grad)
    for index, chunk in enumerate(chunks):
        mine = [c for c in candidates if c.chunk == index]
        base = getattr(chunk, "hf_source_path", None)
        chunk.lora_state = LoRAState(config, mine, conversion, plan, base)
    return model


def adapters(model) -> Iterator[LoRAAdapter]:
    """Every adapter of the model's chunks on this rank."""
    for chunk in model_chunks(model):
        state = getattr(chunk, "lora_state", None)
        for cand in state.adapted if state is not None else ():
            yield cand.module.lora


def lora_parameters(model) -> list[torch.nn.Parameter]:
    """The adapter parameters of this rank (the only ones that require grad after
    :func:`apply_lora`)."""
    return [p for adapter in adapters(model) for p in adapter.parameters()]


@contextlib.contextmanager
def disable_lora(model):
    """Run the base model inside the block (e.g. reference log-probs for RL): every adapter
    of the model is switched off and restored on exit."""
    if lora_state(model) is None:
        raise LoRAConfigError("disable_lora: the model has no LoRA adapters")
    found = list(adapters(model))
    before = [adapter.enabled for adapter in found]
    for adapter in found:
        adapter.enabled = False
    try:
        yield model
    finally:
        for adapter, enabled in zip(found, before, strict=True):
            adapter.enabled = enabled

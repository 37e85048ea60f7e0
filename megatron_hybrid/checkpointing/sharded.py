"""Sharded state dicts of hybrid stacks: module paths to checkpoint keys.

Local (``state_dict``) keys always follow module paths (``decoder.layers.2.layers.1.mlp...``);
only the *sharded* keys, the ones stored in a ``torch_dist`` checkpoint, are rewritten:

* a pattern without groups keeps megatron-core's keys: ``decoder.layers.<physical index>.`` and
  ``decoder.final_norm.`` — existing hybrid checkpoints keep loading;
* a grouped pattern uses logical, Transformer-style keys: every physical layer of logical layer
  ``L`` lands under ``decoder.layers.<L>.`` and the final norm under ``decoder.final_layernorm.``;
* when every logical layer is the same GPT-equivalent group (``[*E]{L}``, ``[*-]{L}``), the keys
  take TransformerBlock's homogeneous form (``decoder.layers.<suffix>`` with a leading layer
  axis of global size L), unless ``metadata`` or the config ask for the indexed form — the rules
  TransformerBlock applies, so the result *is* GPTModel's sharded state dict.

Keys never depend on the pipeline split: indices are global.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.utils import sharded_state_dict_default

from megatron_hybrid.checkpointing.equivalence import is_gpt_equivalent_group, uniform_gpt_layers
from megatron_hybrid.checkpointing.keys import (
    final_norm_name,
    logical_layer_key,
    mtp_layer_prefix,
    physical_layer_key,
    uses_stacked_form,
)

__all__ = [
    "CheckpointKeyLayout",
    "gpt_mtp_keys",
    "model_sharded_state",
    "stack_sharded_state_dict",
]


@dataclass(frozen=True)
class CheckpointKeyLayout:
    """How a grouped pattern's layers map to checkpoint keys (None for ungrouped patterns).

    Attributes:
        num_logical_layers: logical layers of the whole main pattern (all stages).
        uniform_gpt_layers: every logical layer is the same GPT-equivalent group, so the
            homogeneous (stacked) form is possible.
    """

    num_logical_layers: int
    uniform_gpt_layers: bool

    @classmethod
    def for_pattern(cls, pattern) -> CheckpointKeyLayout | None:
        """Layout of a parsed pattern; None when its main part has no group."""
        if not pattern.has_groups:
            return None
        return cls(
            num_logical_layers=pattern.logical_layer_count,
            uniform_gpt_layers=uniform_gpt_layers(pattern),
        )

    def stacked(self, config, metadata: dict | None) -> bool:
        """Whether to use the homogeneous form, by TransformerBlock's rules."""
        return uses_stacked_form(self.uniform_gpt_layers, config, metadata)


def _member_sharded_state_dict(member, local_prefix, target_prefix, offsets, metadata):
    sharded = member.sharded_state_dict(local_prefix, offsets, metadata)
    replace_prefix_for_sharding(sharded, local_prefix, target_prefix)
    return sharded


def stack_sharded_state_dict(stack, prefix: str, sharded_offsets: tuple, metadata: dict | None):
    """Sharded state dict of a top-level :class:`~megatron_hybrid.HybridStack`.

    Args:
        stack: the stack (its ``checkpoint_keys`` decides the key layout).
        prefix: module prefix, e.g. ``"decoder."``.
        sharded_offsets: offsets from the parent (empty for a decoder).
        metadata: dist-checkpointing metadata (``non_homogeneous_layers``, ...).

    Returns:
        The sharded state dict.
    """
    layout = stack.checkpoint_keys
    layer_prefix = f"{prefix}layers."
    sharded = {}
    if layout is None:
        for index, layer in enumerate(stack.layers):
            local = f"{layer_prefix}{index}."
            target = physical_layer_key(layer.layer_number - 1, prefix).prefix
            sharded.update(_member_sharded_state_dict(layer, local, target, [], metadata))
    else:
        stacked = layout.stacked(stack.config, metadata)
        for index, (item, layer) in enumerate(
            zip(stack.layer_type_list, stack.layers, strict=True)
        ):
            key = logical_layer_key(
                stack.logical_layer_offset + index,
                layout.num_logical_layers,
                stacked=stacked,
                prefix=prefix,
            )
            target = key.prefix
            offsets = [(0, *key.layer_axis)] if key.layer_axis is not None else []
            if isinstance(item, tuple):
                members = [
                    (f"{layer_prefix}{index}.layers.{j}.", member)
                    for j, member in enumerate(layer.layers)
                ]
            else:
                members = [(f"{layer_prefix}{index}.", layer)]
            for local, member in members:
                sharded.update(_member_sharded_state_dict(member, local, target, offsets, metadata))
    final_norm_key = final_norm_name(grouped=layout is not None)

    for name, module in stack.named_children():
        if module is stack.layers:
            continue
        local = f"{prefix}{name}."
        child = sharded_state_dict_default(
            module, local, sharded_offsets, metadata, tp_group=stack.tp_group
        )
        if name == "final_norm":
            replace_prefix_for_sharding(child, local, f"{prefix}{final_norm_key}.")
        sharded.update(child)
    return sharded


def gpt_mtp_keys(sharded_state_dict, prefix: str, pattern) -> None:
    """Store a GPT-equivalent MTP depth under GPTModel's MTP keys, in place.

    megatron-core builds each MTP depth of a hybrid pattern as a small HybridStack
    (``mtp.layers.<d>.mtp_model_layer.layers.<j>.``); GPTModel's depth is one TransformerLayer
    (``mtp.layers.<d>.transformer_layer.``). When the main pattern is grouped and the MTP pattern
    is an attention layer followed by an MLP/MoE layer, both members take GPT's prefix, as the
    members of a main-pattern group do.
    """
    if not pattern.has_groups or not is_gpt_equivalent_group(pattern.mtp_items):
        return
    for depth in range(pattern.mtp_num_depths):
        for member in range(len(pattern.mtp_items)):
            source = prefix + mtp_layer_prefix(depth, member)
            target = prefix + mtp_layer_prefix(depth, member, pattern)
            for value in sharded_state_dict.values():
                key = getattr(value, "key", None)
                if isinstance(key, str) and key.startswith(source):
                    value.key = target + key[len(source) :]


def model_sharded_state(chunks, metadata: dict | None = None) -> dict:
    """The model part of a checkpoint in Megatron-LM's layout: ``{"model": ...}`` for one chunk,
    ``{"model0": ..., "model1": ...}`` for virtual pipeline stages.

    Args:
        chunks: the model chunks of this rank, unwrapped (no DDP / Float16Module).
        metadata: sharded-state-dict metadata.
    """
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": c.sharded_state_dict(metadata=metadata) for i, c in enumerate(chunks)}

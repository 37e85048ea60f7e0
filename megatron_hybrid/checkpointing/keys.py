"""Checkpoint key prefixes of hybrid layers (pure Python: no torch, no megatron).

The rules (``DESIGN.md`` §4.2), independent of the pipeline split because indices are global:

* a pattern whose main part holds a group uses Transformer-style logical keys: every physical
  layer of logical layer ``L`` is stored under ``decoder.layers.{L}.`` (group members differ
  only by the suffix that follows), and the final norm under ``decoder.final_layernorm.``;
* a pattern without groups keeps megatron-core's hybrid keys: ``decoder.layers.{p}.`` with ``p``
  the global 0-based physical index (equal to the logical index there) and ``decoder.final_norm.``;
* MTP depth ``d`` (0-based), layer ``j`` of that depth:
  ``mtp.layers.{d}.mtp_model_layer.layers.{j}.``, or for a GPT-layer depth of a grouped pattern
  GPTModel's ``mtp.layers.{d}.transformer_layer.``.

>>> decoder_layer_prefix("[*-]{3}[*E]{58}", 60)
'decoder.layers.60.'
>>> final_norm_prefix("[*E]{4}"), final_norm_prefix("M*M-")
('decoder.final_layernorm.', 'decoder.final_norm.')
>>> mtp_layer_prefix(0, 1)
'mtp.layers.0.mtp_model_layer.layers.1.'
"""

from __future__ import annotations

from megatron_hybrid.checkpointing.equivalence import is_gpt_equivalent_group
from megatron_hybrid.pattern import ParsedPattern, parse_pattern

__all__ = ["decoder_layer_prefix", "final_norm_prefix", "mtp_layer_prefix"]


def _check_index(name: str, value: int, stop: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if stop is not None and value >= stop:
        raise ValueError(f"{name} ({value}) must be < {stop}")


def decoder_layer_prefix(pattern: str | ParsedPattern, logical_index: int) -> str:
    """Return the checkpoint key prefix of logical layer ``logical_index`` of the main pattern.

    For a grouped pattern every member of the group shares this prefix. For a pattern without
    groups the logical index is the physical index, so this is megatron-core's own key.

    >>> decoder_layer_prefix("M[*E]-", 1), decoder_layer_prefix("M*E-", 1)
    ('decoder.layers.1.', 'decoder.layers.1.')
    """
    parsed = parse_pattern(pattern)
    _check_index("logical_index", logical_index, parsed.logical_layer_count)
    return f"decoder.layers.{logical_index}."


def mtp_layer_prefix(depth: int, index: int, pattern: str | ParsedPattern | None = None) -> str:
    """Return the checkpoint key prefix of layer ``index`` (0-based) of MTP depth ``depth``.

    With ``pattern`` given, a grouped main pattern whose MTP depth is a GPT layer (attention then
    MLP/MoE, e.g. ``[*E]{4}/*E``) stores both members under GPTModel's MTP key, as the members of
    a main-pattern group share one prefix. Without it, megatron-core's hybrid MTP key.

    >>> mtp_layer_prefix(0, 1, "[*E]{4}/*E"), mtp_layer_prefix(0, 1, "*E/*E")
    ('mtp.layers.0.transformer_layer.', 'mtp.layers.0.mtp_model_layer.layers.1.')
    """
    _check_index("depth", depth)
    _check_index("index", index)
    if pattern is not None:
        parsed = parse_pattern(pattern)
        if parsed.has_groups and is_gpt_equivalent_group(parsed.mtp_items):
            return f"mtp.layers.{depth}.transformer_layer."
    return f"mtp.layers.{depth}.mtp_model_layer.layers.{index}."


def final_norm_prefix(pattern: str | ParsedPattern) -> str:
    """Return the checkpoint key prefix of the decoder's final norm.

    Grouped patterns use GPTModel's name so that GPT checkpoints load unchanged; patterns without
    groups keep megatron-core's hybrid name.
    """
    if parse_pattern(pattern).has_groups:
        return "decoder.final_layernorm."
    return "decoder.final_norm."

"""Checkpoint key prefixes of hybrid layers (pure Python: no torch, no megatron).

The rules (``docs/checkpoints.md`` section 1; the guarantee they keep is in
``docs/architecture.md``, "Guarantees and targets"), independent of the pipeline split because
indices are global:

* a pattern whose main part holds a group uses Transformer-style logical keys: every physical
  layer of logical layer ``L`` is stored under ``decoder.layers.{L}.`` (group members differ
  only by the suffix that follows), and the final norm under ``decoder.final_layernorm.``;
* when every logical layer is the same GPT-equivalent group (``[*E]{L}``), GPTModel's stacked
  form is the default instead: every layer under ``decoder.layers.`` with a leading layer axis of
  size L, layer ``L`` at index ``L`` of it (:class:`LayerKey` says which; ``metadata`` or the
  config can ask for the indexed form, :func:`uses_stacked_form`);
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
>>> str(decoder_layer_key("[*E]{4}", 1)), str(decoder_layer_key("[*-][*E]", 1))
('decoder.layers. [1/4]', 'decoder.layers.1.')
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hybrid.checkpointing.equivalence import is_gpt_equivalent_group, uniform_gpt_layers
from megatron_hybrid.checks import check_int
from megatron_hybrid.pattern import ParsedPattern, parse_pattern

__all__ = [
    "LayerKey",
    "decoder_layer_key",
    "decoder_layer_prefix",
    "final_norm_name",
    "final_norm_prefix",
    "logical_layer_key",
    "mtp_layer_prefix",
    "physical_layer_key",
    "uses_stacked_form",
]


@dataclass(frozen=True)
class LayerKey:
    """Where the parameters of one decoder layer are stored.

    Attributes:
        prefix: the key prefix, e.g. ``decoder.layers.3.`` (indexed) or ``decoder.layers.``
            (stacked).
        layer_axis: in the stacked form, ``(index, size)`` of the layer on the leading layer axis
            every tensor gets; None in the indexed form.
    """

    prefix: str
    layer_axis: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.layer_axis is None:
            return self.prefix
        index, size = self.layer_axis
        return f"{self.prefix} [{index}/{size}]"


def _check_index(name: str, value: int, stop: int | None = None) -> None:
    value = check_int(name, value, 0)
    if stop is not None and value >= stop:
        raise ValueError(f"{name} ({value}) must be < {stop}")


def physical_layer_key(physical_index: int, prefix: str = "decoder.") -> LayerKey:
    """Key of a layer of a pattern without groups: megatron-core's, by global physical index."""
    _check_index("physical_index", physical_index)
    return LayerKey(f"{prefix}layers.{physical_index}.")


def logical_layer_key(
    logical_index: int, num_logical_layers: int, *, stacked: bool, prefix: str = "decoder."
) -> LayerKey:
    """Key of logical layer ``logical_index`` of a grouped pattern.

    Args:
        logical_index: global logical index.
        num_logical_layers: logical layers of the whole main pattern (all stages).
        stacked: GPTModel's homogeneous form (:func:`uses_stacked_form`).
        prefix: the stack's module prefix.
    """
    _check_index("logical_index", logical_index, num_logical_layers)
    if stacked:
        return LayerKey(f"{prefix}layers.", (logical_index, num_logical_layers))
    return LayerKey(f"{prefix}layers.{logical_index}.")


def uses_stacked_form(uniform_gpt: bool, config=None, metadata: dict | None = None) -> bool:
    """Whether a grouped stack takes GPTModel's stacked form, by TransformerBlock's rules.

    Args:
        uniform_gpt: every logical layer is the same GPT-equivalent group.
        config: the ``TransformerConfig`` (or None: its defaults).
        metadata: sharded-state-dict metadata (``non_homogeneous_layers``,
            ``singleton_local_shards`` ask for the indexed form).
    """
    if not uniform_gpt:
        return False
    metadata = metadata or {}
    if metadata.get("non_homogeneous_layers", False):
        return False
    if metadata.get("singleton_local_shards", False):
        return False
    if getattr(config, "hetereogenous_dist_checkpoint", False):
        return False
    if getattr(config, "heterogeneous_block_specs", False):
        return False
    for freq_name in ("moe_layer_freq", "linear_attention_freq"):
        freq = getattr(config, freq_name, None)
        if isinstance(freq, list) or (isinstance(freq, int) and freq > 1):
            return False
    return True


def decoder_layer_key(
    pattern: str | ParsedPattern, logical_index: int, metadata: dict | None = None
) -> LayerKey:
    """Key of logical layer ``logical_index`` of the main pattern, as a default config saves it.

    >>> decoder_layer_key("[*E]{4}", 2, {"non_homogeneous_layers": True}).prefix
    'decoder.layers.2.'
    """
    parsed = parse_pattern(pattern)
    _check_index("logical_index", logical_index, parsed.logical_layer_count)
    if not parsed.has_groups:
        return physical_layer_key(logical_index)
    stacked = uses_stacked_form(uniform_gpt_layers(parsed), None, metadata)
    return logical_layer_key(logical_index, parsed.logical_layer_count, stacked=stacked)


def decoder_layer_prefix(pattern: str | ParsedPattern, logical_index: int) -> str:
    """Return the indexed checkpoint key prefix of logical layer ``logical_index``.

    For a grouped pattern every member of the group shares this prefix; it is the key when the
    indexed form is used (:func:`decoder_layer_key` gives the form a default config saves). For a
    pattern without groups the logical index is the physical index, so this is megatron-core's
    own key.

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


def final_norm_name(grouped: bool) -> str:
    """Name the final norm is stored under: GPTModel's for grouped patterns, else megatron-core's
    hybrid name."""
    return "final_layernorm" if grouped else "final_norm"


def final_norm_prefix(pattern: str | ParsedPattern) -> str:
    """Return the checkpoint key prefix of the decoder's final norm.

    Grouped patterns use GPTModel's name so that GPT checkpoints load unchanged; patterns without
    groups keep megatron-core's hybrid name.
    """
    return f"decoder.{final_norm_name(parse_pattern(pattern).has_groups)}."

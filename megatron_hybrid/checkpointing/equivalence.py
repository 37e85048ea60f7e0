"""Which logical layers of a pattern are GPTModel layers (pure Python).

A GPT ``TransformerLayer`` is an attention half followed by an MLP half. A group made of one
layer type whose ``gpt_role`` (in the layer-type table) is attention (``*``, ``+`` MLA, ``D``
DSA) followed by one whose role is MLP (``-`` dense, ``E`` MoE) therefore has exactly the
parameters of a GPT layer, and the package stores it under a GPT layer's checkpoint keys.

>>> is_gpt_equivalent_group(("*", "E"))
True
>>> is_gpt_equivalent_group(("G", "E"))
False
>>> gpt_equivalent_layers("[*-]{2}[*E]")
True
>>> gpt_equivalent_layers("*E")
False
"""

from __future__ import annotations

from megatron_hybrid.pattern import LAYER_TYPES, GptRole, ParsedPattern, parse_pattern

__all__ = [
    "gpt_equivalent_layers",
    "gpt_role_symbols",
    "is_gpt_equivalent_group",
    "uniform_gpt_layers",
]


def gpt_role_symbols(role: GptRole) -> frozenset[str]:
    """The symbols of the layer types that play ``role`` in a GPT layer, read from the table
    now (so registered types count).

    >>> sorted(gpt_role_symbols(GptRole.ATTENTION)), sorted(gpt_role_symbols(GptRole.MLP))
    (['*', '+', 'D'], ['-', 'E'])
    """
    return frozenset(s for s, facts in LAYER_TYPES.items() if facts.gpt_role == role)


def _role(symbol: str) -> GptRole | None:
    facts = LAYER_TYPES.get(symbol)
    return facts.gpt_role if facts is not None else None


def is_gpt_equivalent_group(members) -> bool:
    """Whether a group's members are exactly a GPT layer: attention then MLP/MoE."""
    members = tuple(members)
    return (
        len(members) == 2
        and _role(members[0]) == GptRole.ATTENTION
        and _role(members[1]) == GptRole.MLP
    )


def gpt_equivalent_layers(pattern: str | ParsedPattern) -> bool:
    """Whether every logical layer of the main pattern is a GPT-equivalent group."""
    parsed = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    return bool(parsed.logical_layers) and all(
        layer.is_group and is_gpt_equivalent_group(layer.members) for layer in parsed.logical_layers
    )


def uniform_gpt_layers(pattern: str | ParsedPattern) -> bool:
    """Whether every logical layer is the *same* GPT-equivalent group (e.g. ``[*E]{24}``).

    Only such a pattern can take GPTModel's stacked (homogeneous) checkpoint form, where each
    parameter is one tensor with a leading layer dimension under ``decoder.layers.``.

    >>> uniform_gpt_layers("[*E]{4}"), uniform_gpt_layers("[*-][*E]{2}"), uniform_gpt_layers("*E")
    (True, False, False)
    """
    parsed = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    kinds = {layer.members for layer in parsed.logical_layers}
    return gpt_equivalent_layers(parsed) and len(kinds) == 1

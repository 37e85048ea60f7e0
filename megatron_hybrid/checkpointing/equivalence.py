"""Which logical layers of a pattern are GPTModel layers (pure Python).

A GPT ``TransformerLayer`` is an attention half followed by an MLP half. A group made of one
attention-type symbol (``*`` attention, ``+`` MLA, ``D`` DSA) followed by one MLP-type symbol
(``-`` dense, ``E`` MoE) therefore has exactly the parameters of a GPT layer, and the package
stores it under a GPT layer's checkpoint keys.

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

from megatron_hybrid.pattern import ATTENTION, DSA, MLA, MLP, MOE, ParsedPattern, parse_pattern

__all__ = [
    "GPT_ATTENTION_SYMBOLS",
    "GPT_MLP_SYMBOLS",
    "gpt_equivalent_layers",
    "is_gpt_equivalent_group",
    "uniform_gpt_layers",
]

GPT_ATTENTION_SYMBOLS = frozenset({ATTENTION, MLA, DSA})
GPT_MLP_SYMBOLS = frozenset({MLP, MOE})


def is_gpt_equivalent_group(members) -> bool:
    """Whether a group's members are exactly a GPT layer: attention then MLP/MoE."""
    members = tuple(members)
    return (
        len(members) == 2 and members[0] in GPT_ATTENTION_SYMBOLS and members[1] in GPT_MLP_SYMBOLS
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

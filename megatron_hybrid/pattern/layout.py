"""Parsed patterns as frozen data: items, counts and logical layers, and the checks on them.

An *item* is one logical layer: a symbol (``"E"``) or a group (``("*", "E")``). This module never
parses text: :func:`megatron_hybrid.pattern.parse_pattern` builds a :class:`ParsedPattern`, and
:mod:`megatron_hybrid.pattern.pipeline` cuts it into pipeline (virtual) stages.

>>> from megatron_hybrid.pattern import parse_pattern
>>> p = parse_pattern("[*-]{2}|[*E]{2}/*E")
>>> items_to_str(p.segments[1]), p.logical_layers[2].layer_numbers
('[*E][*E]', (5, 6))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from megatron_hybrid.pattern.errors import HybridPatternError
from megatron_hybrid.pattern.layer_types import SYMBOL_NAMES, layer_symbols
from megatron_hybrid.pattern.symbols import (
    ATTENTION,
    DSA,
    GRAMMAR_VERSION,
    MLA,
    MTP_SEPARATOR,
    PIPE,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = [
    "Item",
    "LogicalLayer",
    "ParsedPattern",
    "flatten_items",
    "item_physical_count",
    "item_to_str",
    "items_to_str",
    "make_parsed_pattern",
]

#: One logical layer: a layer symbol, or a group as a tuple of symbols.
Item: TypeAlias = str | tuple[str, ...]


def item_physical_count(item: Item) -> int:
    """Return how many physical layers ``item`` holds.

    >>> item_physical_count("E"), item_physical_count(("M", "*", "E"))
    (1, 3)
    """
    return len(item) if isinstance(item, tuple) else 1


@functools.lru_cache(maxsize=1024)  # few distinct items; canonical strings write them many times
def item_to_str(item: Item) -> str:
    """Write one item in pattern syntax.

    >>> item_to_str("E"), item_to_str(("*", "E"))
    ('E', '[*E]')
    """
    return f"[{''.join(item)}]" if isinstance(item, tuple) else item


def items_to_str(items: Iterable[Item]) -> str:
    """Write items in pattern syntax (the canonical form: no repetition, no parentheses).

    >>> items_to_str(["M", ("*", "E"), "-"])
    'M[*E]-'
    """
    return "".join(map(item_to_str, items))


def flatten_items(items: Iterable[Item]) -> tuple[str, ...]:
    """Return the physical layer symbols of ``items``, groups opened in place.

    >>> flatten_items(["M", ("*", "E"), "-"])
    ('M', '*', 'E', '-')
    """
    out: list[str] = []
    for item in items:
        if isinstance(item, tuple):
            out.extend(item)
        else:
            out.append(item)
    return tuple(out)


class LogicalLayer(NamedTuple):
    """One logical layer of the main pattern: a plain layer or a whole group.

    A named tuple rather than a dataclass because patterns hold up to 100,000 of them and tuples
    are several times cheaper to create; it is immutable all the same.

    Attributes:
        index: Global logical index (0-based, across all pipeline segments).
        members: The physical layer symbols, one for a plain layer.
        layer_numbers: Global 1-based physical layer numbers of ``members`` (megatron-core's
            ``layer_number``).
        segment: Index of the ``|``-delimited segment holding the layer.
        is_group: Whether the layer was written as a group ``[...]`` (``[E]`` is a group).
        position: Index in the pattern as typed of the symbol or ``[`` that produced the layer
            (repetitions of one item share it).
    """

    index: int
    members: tuple[str, ...]
    layer_numbers: tuple[int, ...]
    segment: int
    is_group: bool
    position: int

    @property
    def item(self) -> Item:
        """The layer as an item: the members tuple for a group, else the single symbol."""
        return self.members if self.is_group else self.members[0]


@dataclass(frozen=True, slots=True)
class ParsedPattern:
    """A parsed hybrid layer pattern (see ``docs/pattern_grammar.md``).

    Build it with :func:`megatron_hybrid.pattern.parse_pattern`. Counts cover the main pattern
    only, except :attr:`layer_counts`, which adds every MTP depth.

    >>> from megatron_hybrid.pattern import parse_pattern
    >>> p = parse_pattern("[*-]{2}|[*E]{2}/*E")
    >>> p.canonical, p.num_segments, p.mtp_pattern, p.mtp_num_depths
    ('[*-][*-]|[*E][*E]/*E', 2, '*E', 1)
    >>> p.physical_layer_count, p.logical_layer_count
    (8, 4)
    >>> p.logical_layers[2]
    LogicalLayer(index=2, members=('*', 'E'), layer_numbers=(5, 6), segment=1, is_group=True, \
position=8)

    Attributes:
        pattern: The pattern exactly as typed.
        canonical: Fully expanded pattern using only ``M G * D + - E [ ] | /``.
        segments: Items of each ``|``-delimited segment of the main pattern.
        items: All main items, segments concatenated.
        mtp_items: Layer symbols of one MTP depth (empty without MTP).
        mtp_num_depths: Number of MTP depths (0 without MTP).
        logical_layers: Every logical layer of the main pattern, in order.
        physical_layer_count: Physical layers of the main pattern (what
            ``TransformerConfig.num_layers`` means).
        has_groups: Whether the main pattern holds a group (this decides the checkpoint keys).
        version: Grammar version the pattern was parsed with.
    """

    pattern: str
    canonical: str
    segments: tuple[tuple[Item, ...], ...]
    items: tuple[Item, ...]
    mtp_items: tuple[str, ...]
    mtp_num_depths: int
    logical_layers: tuple[LogicalLayer, ...]
    physical_layer_count: int
    has_groups: bool
    version: int = GRAMMAR_VERSION

    def __hash__(self) -> int:
        # Every field follows from the typed string; hashing it alone keeps hashing cheap for
        # patterns with 100,000 layers.
        return hash(self.pattern)

    @property
    def num_segments(self) -> int:
        """Number of ``|``-delimited segments (1 for a pattern without ``|``)."""
        return len(self.segments)

    @property
    def unsplit(self) -> str:
        """The canonical string without ``|``: the same layers as one pipeline stage.

        Checkpoint keys and global shapes do not depend on the pipeline split, so tools that
        only need those build this pattern at PP=1.

        >>> from megatron_hybrid.pattern import parse_pattern
        >>> parse_pattern("[*-]{2}|[*E]{2}/*E").unsplit
        '[*-][*-][*E][*E]/*E'
        """
        return self.canonical.replace(PIPE, "")

    @property
    def flat(self) -> str:
        """The canonical string with every group opened in place (``|`` and ``/`` kept): the
        same physical layers in megatron-core's own grammar, which knows no groups.

        >>> from megatron_hybrid.pattern import parse_pattern
        >>> parse_pattern("[*-]{2}|[*E]{2}/*E").flat
        '*-*-|*E*E/*E'
        """
        main = PIPE.join("".join(flatten_items(segment)) for segment in self.segments)
        return main + (MTP_SEPARATOR + "".join(self.mtp_items)) * self.mtp_num_depths

    @property
    def main_pattern(self) -> str:
        """Canonical main part (``""`` when empty)."""
        return self.canonical.split(MTP_SEPARATOR, 1)[0]

    @property
    def mtp_pattern(self) -> str | None:
        """Canonical layers of one MTP depth, or ``None`` without MTP."""
        return "".join(self.mtp_items) if self.mtp_num_depths else None

    @property
    def logical_layer_count(self) -> int:
        """Logical layers of the main pattern (a group counts 1)."""
        return len(self.logical_layers)

    @property
    def layer_counts(self) -> dict[str, int]:
        """Physical layers per symbol over main and MTP (MTP counted once per depth).

        >>> from megatron_hybrid.pattern import parse_pattern
        >>> parse_pattern("M[*E]M/*E/*E").layer_counts
        {'M': 2, 'G': 0, '*': 3, 'D': 0, '+': 0, '-': 0, 'E': 3}
        """
        counts = dict.fromkeys(layer_symbols(), 0)
        for symbol in flatten_items(self.items):
            counts[symbol] += 1
        for symbol in self.mtp_items:
            counts[symbol] += self.mtp_num_depths
        return counts


def make_parsed_pattern(
    pattern: str,
    segments: Sequence[Sequence[Item]],
    positions: Sequence[Sequence[int]],
    mtp_items: Sequence[str],
    mtp_num_depths: int,
) -> ParsedPattern:
    """Assemble a :class:`ParsedPattern` from expanded segments (used by the parser).

    Args:
        pattern: The pattern as typed.
        segments: Expanded items per segment.
        positions: For each item, the index in ``pattern`` of the symbol or ``[`` it came from.
        mtp_items: Layer symbols of one MTP depth.
        mtp_num_depths: Number of MTP depths.
    """
    layers: list[LogicalLayer] = []
    physical = 0
    singles = {symbol: (symbol,) for symbol in layer_symbols()}
    new = tuple.__new__  # skips NamedTuple's keyword handling: this loop runs once per layer
    for segment_index, (segment, segment_positions) in enumerate(
        zip(segments, positions, strict=True)
    ):
        for item, position in zip(segment, segment_positions, strict=True):
            if isinstance(item, tuple):
                count = len(item)
                numbers = tuple(range(physical + 1, physical + count + 1))
                layer = (len(layers), item, numbers, segment_index, True, position)
            else:
                count = 1
                layer = (
                    len(layers),
                    singles[item],
                    (physical + 1,),
                    segment_index,
                    False,
                    position,
                )
            layers.append(new(LogicalLayer, layer))
            physical += count
    frozen_segments = tuple(tuple(segment) for segment in segments)
    main = PIPE.join(items_to_str(segment) for segment in frozen_segments)
    mtp = "".join(mtp_items)
    return ParsedPattern(
        pattern=pattern,
        canonical=main + (MTP_SEPARATOR + mtp) * mtp_num_depths,
        segments=frozen_segments,
        items=tuple(item for segment in frozen_segments for item in segment),
        mtp_items=tuple(mtp_items),
        mtp_num_depths=mtp_num_depths,
        logical_layers=tuple(layers),
        physical_layer_count=physical,
        has_groups=any(layer.is_group for layer in layers),
    )


def check_mtp_parts(pattern: str, parts: list[tuple[str, ...]]) -> None:
    """Raise unless every expanded MTP depth holds the same layers (the parser's check)."""
    for depth, part in enumerate(parts[1:], start=2):
        if part != parts[0]:
            first, other = "".join(parts[0]), "".join(part)
            raise HybridPatternError(
                f"all MTP depths must be identical, but depth 1 is '{first}' and depth {depth} "
                f"is '{other}' (after expansion)",
                pattern,
                None,
                "the same layers after every '/'",
                f"each '/' part is one MTP depth: repeat the same layers, e.g. "
                f"'.../{first}/{first}'",
            )


def check_attention_family(pattern: str, symbols: set[str]) -> None:
    """Raise if ``symbols`` mixes ``*`` with MLA or DSA attention (the parser's check)."""
    if ATTENTION not in symbols:
        return
    for other in (DSA, MLA):
        if other in symbols:
            raise HybridPatternError(
                f"'{ATTENTION}' ({SYMBOL_NAMES[ATTENTION]}) and '{other}' ({SYMBOL_NAMES[other]}) "
                "cannot be used in one model",
                pattern,
                None,
                f"either '{ATTENTION}' or MLA/DSA ('{MLA}', '{DSA}') attention",
                "megatron-core builds one attention kind per model: use '*' everywhere, or "
                "'+'/'D' everywhere",
            )

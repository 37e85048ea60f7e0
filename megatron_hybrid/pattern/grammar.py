"""Recursive-descent parser for hybrid layer patterns.

Grammar (``docs/pattern_grammar.md`` explains every rule and error)::

    pattern  := main ( "/" mtp )*
    main     := segment ( "|" segment )*
    segment  := item*
    mtp      := item*                      no group, no "|"
    item     := unit ( "{" N "}" )?        N >= 1
    unit     := SYMBOL | group | "(" item+ ")"
    group    := "[" SYMBOL+ "]"            at most one layer per slot, the MLP-slot layer last

Two passes over the tokens of :mod:`megatron_hybrid.pattern.tokenizer`: the first builds a tree
that knows each node's physical layer count (saturating at 10**15), so ``[*E]{1000000000}`` fails
before anything is expanded; the second expands the tree into items.

>>> parse_pattern("(M-M*-){2}").canonical
'M-M*-M-M*-'
>>> parse_pattern("[*-]{3}[*E]{58}").logical_layer_count
61
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from megatron_hybrid.pattern.errors import HybridPatternError
from megatron_hybrid.pattern.layer_types import (
    SLOT_OF_SYMBOL,
    SYMBOL_NAMES,
    alphabet_version,
    layer_symbols,
)
from megatron_hybrid.pattern.layout import (
    Item,
    ParsedPattern,
    check_attention_family,
    check_mtp_parts,
    make_parsed_pattern,
)
from megatron_hybrid.pattern.symbols import (
    GROUP_OPEN,
    MAX_NESTING_DEPTH,
    MAX_PATTERN_LENGTH,
    MAX_PHYSICAL_LAYERS,
    Slot,
)
from megatron_hybrid.pattern.tokenizer import (
    COUNT_CAP,
    END,
    GROUP_END,
    GROUP_START,
    LITERAL,
    MTP_SEP,
    REPEAT,
    RUN_END,
    RUN_START,
    SEGMENT_SEP,
    Token,
    lexicon,
    read_literal,
    tokenize,
)

__all__ = ["parse_pattern"]


def _slot_list() -> str:
    """'one mixer (M), one attention (* D + G) and one MLP (- E)' for the current alphabet."""
    by_slot = {slot: [s for s in layer_symbols() if SLOT_OF_SYMBOL[s] == slot] for slot in Slot}
    names = {Slot.MIXER: "mixer", Slot.ATTENTION: "attention", Slot.MLP: "MLP"}
    parts = [f"one {names[slot]} ({' '.join(by_slot[slot])})" for slot in Slot]
    return f"{', '.join(parts[:-1])} and {parts[-1]}"


# A node of the parse tree; counts are physical layers, saturated at COUNT_CAP.
class _Unit(NamedTuple):
    # LITERAL: value = (items, their offsets in the literal); GROUP_START: the group's members;
    # RUN_START: the nodes inside '(...)'.
    kind: int
    value: tuple[tuple[Item, ...], tuple[int, ...]] | tuple[str, ...] | tuple[_Node, ...]
    position: int
    physical: int


class _Node(NamedTuple):
    unit: _Unit
    repeat: int
    physical: int


_MAIN, _MTP = "main", "MTP"


class _Parser:
    """Recursive descent over the token list; every method raises at the first bad token."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.tokens = tokenize(pattern)
        self.index = 0

    def error(
        self, message: str, position: int | None, expected: str, hint: str | None = None
    ) -> HybridPatternError:
        return HybridPatternError(message, self.pattern, position, expected, hint)

    def peek(self) -> Token:
        token = self.tokens[self.index]
        if token.error is not None:
            raise token.error
        return token

    def advance(self) -> Token:
        token = self.peek()
        self.index += 1
        return token

    def parse(self) -> tuple[list[list[_Node]], list[list[_Node]]]:
        """Return the nodes of every main segment and of every MTP part."""
        segments = [self.sequence(_MAIN, 0, None)]
        while self.peek().kind == SEGMENT_SEP:
            self.advance()
            segments.append(self.sequence(_MAIN, 0, None))
        mtp_parts = []
        while self.peek().kind == MTP_SEP:
            self.advance()
            mtp_parts.append(self.sequence(_MTP, 0, None))
        assert self.peek().kind == END, "sequence() stops only at '|', '/' or the end"
        return segments, mtp_parts

    def sequence(self, part: str, depth: int, run_open: Token | None) -> list[_Node]:
        """Parse items up to the end of a segment, an MTP part or a parenthesised run."""
        nodes: list[_Node] = []
        while True:
            token = self.peek()
            kind, at = token.kind, token.position
            if kind in (LITERAL, GROUP_START, RUN_START):
                nodes.append(self.item(part, depth))
            elif kind == REPEAT:
                raise self.error(
                    f"'{{' at position {at} has nothing to repeat",
                    at,
                    "a layer symbol, a group '[...]' or a run '(...)' before '{N}'",
                    "write the count right after what it repeats, e.g. '[*E]{4}'",
                )
            elif kind == GROUP_END:
                raise self.error(
                    f"']' at position {at} closes a layer group that was not opened",
                    at,
                    "'[' before the group's layer symbols",
                    "open the group with '[' or remove the ']'",
                )
            elif kind == RUN_END:
                if run_open is None:
                    raise self.error(
                        f"')' at position {at} closes a parenthesis that was not opened",
                        at,
                        "'(' before the repeated layers",
                        "open the run with '(' or remove the ')'",
                    )
                return nodes
            elif run_open is not None and kind in (SEGMENT_SEP, MTP_SEP):
                raise self.error(
                    f"'{token.text}' at position {at} is inside the parentheses opened at "
                    f"position {run_open.position}",
                    at,
                    "')' to close the run before any '|' or '/'",
                    "a repeated run stays within one pipeline segment: close it first, e.g. "
                    "'(*E){2}|(*E){2}'",
                )
            elif kind == SEGMENT_SEP and part == _MTP:
                raise self.error(
                    f"'|' at position {at} is in an MTP part",
                    at,
                    "layer symbols or '/' after '/'",
                    "MTP depths are not pipeline-split: remove the '|' after the first '/'",
                )
            elif kind == END and run_open is not None:
                raise self.error(
                    f"'(' at position {run_open.position} is never closed",
                    run_open.position,
                    "')' followed by a repetition '{N}'",
                    "close the run, e.g. '(M*){3}'",
                )
            else:  # '|', '/' or the end closes this segment or MTP part
                return nodes

    def item(self, part: str, depth: int) -> _Node:
        token = self.advance()
        if token.kind == LITERAL:
            unit = self.literal(token, part)
        elif token.kind == GROUP_START:
            if part == _MTP:
                raise self.group_in_mtp(token.position)
            unit = self.group(token)
        else:
            unit = self.run(part, depth + 1, token)
        following = self.peek()
        if following.kind != REPEAT:
            if unit.kind == RUN_START:
                raise self.error(
                    f"the run '(...)' opened at position {unit.position} is not repeated",
                    following.position,
                    "'{N}' right after ')'",
                    "parentheses only group layers for a repetition: add a count such as "
                    "'{2}' or remove the parentheses",
                )
            return _Node(unit, 1, unit.physical)
        self.advance()
        again = self.peek()
        if again.kind == REPEAT:
            written = self.pattern[unit.position : following.position]
            combined = following.count * again.count
            short = combined < COUNT_CAP and len(written) < 40
            example = f"'{written}{{{combined}}}'" if short else ""
            raise self.error(
                f"'{{' at position {again.position} has nothing to repeat: "
                f"'{written[:40]}' is already repeated by {following.text}",
                again.position,
                "a layer symbol, a group '[...]' or a run '(...)' before '{N}'",
                f"write one count (the product), e.g. {example}" if example else "write one count",
            )
        return _Node(unit, following.count, min(unit.physical * following.count, COUNT_CAP))

    def literal(self, token: Token, part: str) -> _Unit:
        """Symbols and well-formed groups the tokenizer read as one token."""
        text, at = token.text, token.position
        if part == _MTP and GROUP_OPEN in text:
            raise self.group_in_mtp(at + text.index(GROUP_OPEN))
        read = read_literal(text)
        if read is None:  # some group breaks a slot rule: find it and raise with its position
            for match in lexicon().element.finditer(text):
                filled: dict[Slot, tuple[str, int]] = {}
                for offset, symbol in enumerate(match.group().strip("[]")):
                    self.add_member(
                        at + match.start(), symbol, at + match.start() + 1 + offset, filled
                    )
            raise AssertionError("read_literal and add_member disagree")  # pragma: no cover
        items, offsets, physical = read
        return _Unit(LITERAL, (items, offsets), at, physical)

    def group_in_mtp(self, at: int) -> HybridPatternError:
        return self.error(
            f"'[' at position {at} opens a layer group in an MTP part",
            at,
            "plain layer symbols after '/'",
            "each MTP depth is already one fused layer: write its layers without brackets, "
            "e.g. '/*E'",
        )

    def group(self, opening: Token) -> _Unit:
        members: list[str] = []
        filled: dict[Slot, tuple[str, int]] = {}
        while True:
            token = self.peek()
            kind, at = token.kind, token.position
            if kind == LITERAL:
                for offset, symbol in enumerate(token.text):
                    if symbol == GROUP_OPEN:  # a whole group inside this unclosed one
                        raise self.error(
                            f"'[' at position {at + offset} is inside the layer group opened at "
                            f"position {opening.position}",
                            at + offset,
                            "layer symbols or ']'",
                            _INSIDE_GROUP_HINTS[GROUP_START],
                        )
                    self.add_member(opening.position, symbol, at + offset, filled)
                    members.append(symbol)
                self.advance()
            elif kind == GROUP_END:
                if not members:
                    raise self.error(
                        f"empty layer group at position {opening.position}",
                        at,
                        "at least one layer symbol between '[' and ']'",
                        "remove the '[]' or put layers in it, e.g. '[*E]'",
                    )
                self.advance()
                return _Unit(GROUP_START, tuple(members), opening.position, len(members))
            elif kind == END:
                raise self.error(
                    f"'[' at position {opening.position} opens a layer group that is never closed",
                    opening.position,
                    "']' after the group's layer symbols",
                    "close the group, e.g. '[*E]'",
                )
            else:
                raise self.error(
                    f"'{token.text[:1]}' at position {at} is inside the layer group opened at "
                    f"position {opening.position}",
                    at,
                    "layer symbols or ']'",
                    _INSIDE_GROUP_HINTS[kind],
                )

    def add_member(
        self, opening: int, symbol: str, at: int, filled: dict[Slot, tuple[str, int]]
    ) -> None:
        """Check the slot rules for ``symbol`` at ``at`` and record its slot in ``filled``."""
        slot = SLOT_OF_SYMBOL[symbol]
        if slot in filled:
            first, first_at = filled[slot]
            name = "MLP" if slot == Slot.MLP else str(slot)
            raise self.error(
                f"'{symbol}' at position {at} is a second {name}-slot layer in the group opened "
                f"at position {opening} ('{first}' at position {first_at} already fills "
                f"the {name} slot)",
                at,
                f"at most {_slot_list()} per group",
                "a group is one Transformer layer; split it into groups, e.g. '[*E][*E]'",
            )
        if Slot.MLP in filled:
            mlp, mlp_at = filled[Slot.MLP]
            raise self.error(
                f"'{mlp}' ({SYMBOL_NAMES[mlp]}) at position {mlp_at} must be the last layer of "
                f"its group, but '{symbol}' follows it",
                mlp_at,
                "the MLP or MoE layer at the end of the group",
                "move it to the end, e.g. '[*E]' rather than '[E*]'",
            )
        filled[slot] = (symbol, at)

    def run(self, part: str, depth: int, opening: Token) -> _Unit:
        if depth > MAX_NESTING_DEPTH:
            raise self.error(
                f"'(' at position {opening.position} nests parentheses deeper than "
                f"{MAX_NESTING_DEPTH} levels",
                opening.position,
                f"at most {MAX_NESTING_DEPTH} nested '('",
                "multiply the counts instead, e.g. '((M*){2}){3}' is '(M*){6}'",
            )
        nodes = self.sequence(part, depth, opening)
        closing = self.advance()
        if not nodes:
            raise self.error(
                f"empty parentheses at position {opening.position}",
                closing.position,
                "layers between '(' and ')'",
                "remove the '()' or put layers in it, e.g. '(M*){3}'",
            )
        physical = min(sum(node.physical for node in nodes), COUNT_CAP)
        return _Unit(RUN_START, tuple(nodes), opening.position, physical)


_INSIDE_GROUP_HINTS = {
    GROUP_START: "groups cannot be nested; write them one after another, e.g. '[*-][*E]'",
    REPEAT: "repeat the whole group instead, e.g. '[*E]{4}'",
    RUN_START: "repeat the whole group instead, e.g. '[*E]{4}'",
    RUN_END: "close the group with ']' before the ')'",
    SEGMENT_SEP: "close the group with ']' first: '|' goes between groups",
    MTP_SEP: "close the group with ']' first: '/' starts the MTP part after the main pattern",
}


def _expand(
    nodes: list[_Node] | tuple[_Node, ...], items: list[Item], positions: list[int]
) -> None:
    """Append the expansion of ``nodes`` (items and their source positions)."""
    for node in nodes:
        unit = node.unit
        if unit.kind == RUN_START:
            run_items: list[Item] = []
            run_positions: list[int] = []
            _expand(unit.value, run_items, run_positions)  # type: ignore[arg-type]
            items.extend(run_items * node.repeat)
            positions.extend(run_positions * node.repeat)
        elif unit.kind == LITERAL:
            literal_items, offsets = unit.value  # type: ignore[misc]
            literal_positions = [unit.position + offset for offset in offsets]
            items.extend(literal_items * node.repeat)
            positions.extend(literal_positions * node.repeat)
        else:
            items.extend([unit.value] * node.repeat)  # type: ignore[list-item]
            positions.extend([unit.position] * node.repeat)


def _physical(nodes: list[_Node]) -> int:
    return min(sum(node.physical for node in nodes), COUNT_CAP)


def _check_whole_pattern(pattern: str, main: list[list[_Node]], mtp: list[list[_Node]]) -> None:
    """Raise for the errors that concern the whole pattern: no layer, or too many layers."""
    main_size = min(sum(map(_physical, main)), COUNT_CAP)
    mtp_sizes = [_physical(part) for part in mtp]
    total = main_size + sum(mtp_sizes)  # each term is at most COUNT_CAP, so this stays small
    if total == 0:
        what = "the pattern is empty" if not pattern else "the pattern has no layer"
        raise HybridPatternError(
            what, pattern, None, "at least one layer symbol", "write layers, e.g. '[*E]{4}'"
        )
    if total > MAX_PHYSICAL_LAYERS:
        exact = COUNT_CAP not in (main_size, *mtp_sizes)
        size = f"{total:,}" if exact else f"more than {MAX_PHYSICAL_LAYERS:,}"
        raise HybridPatternError(
            f"the pattern expands to {size} physical layers (main plus every MTP depth), above "
            f"the limit of {MAX_PHYSICAL_LAYERS:,}",
            pattern,
            None,
            f"at most {MAX_PHYSICAL_LAYERS:,} physical layers",
            "check the repetition counts {N}",
        )


def parse_pattern(pattern: str | ParsedPattern) -> ParsedPattern:
    """Parse a hybrid layer pattern (cached: model building calls this many times).

    Args:
        pattern: The pattern as written, e.g. ``"[*-]{3}[*E]{58}/*E"``. A
            :class:`ParsedPattern` is returned unchanged.

    Returns:
        The frozen parse result.

    Raises:
        HybridPatternError: The pattern breaks a rule; the message points at the first character
            that cannot be accepted.
        TypeError: ``pattern`` is not a string.

    >>> p = parse_pattern("[*-]{2}|[*E]{2}/*E")
    >>> p.segments
    ((('*', '-'), ('*', '-')), (('*', 'E'), ('*', 'E')))
    >>> parse_pattern("M[M*E]-").logical_layers[1].layer_numbers
    (2, 3, 4)
    >>> parse_pattern("[E*]")
    Traceback (most recent call last):
        ...
    megatron_hybrid.pattern.errors.HybridPatternError: 'E' (MoE) at position 1 must be the last \
layer of its group, but '*' follows it
      pattern: '[E*]'
                 ^
      expected: the MLP or MoE layer at the end of the group
      fix: move it to the end, e.g. '[*E]' rather than '[E*]'
    """
    if isinstance(pattern, ParsedPattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"a hybrid layer pattern must be a str, got {type(pattern).__name__}")
    # The alphabet version is part of the cache key: registering a layer type changes which
    # patterns are valid.
    return _parse(pattern, alphabet_version())


@functools.lru_cache(maxsize=128)
def _parse(pattern: str, version: int) -> ParsedPattern:
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise HybridPatternError(
            f"the pattern is {len(pattern):,} characters long, above the limit of "
            f"{MAX_PATTERN_LENGTH:,}",
            pattern,
            None,
            f"at most {MAX_PATTERN_LENGTH:,} characters",
            "write repeated layers with repetition counts, e.g. '[*E]{64}'",
        )
    main, mtp = _Parser(pattern).parse()
    if all(not part for part in mtp):
        mtp = []  # '*E/' and '*E//' mean no MTP, as upstream
    _check_whole_pattern(pattern, main, mtp)

    segments: list[list[Item]] = []
    positions: list[list[int]] = []
    for nodes in main:
        segments.append([])
        positions.append([])
        _expand(nodes, segments[-1], positions[-1])
    mtp_parts: list[tuple[str, ...]] = []
    for nodes in mtp:
        part: list[Item] = []
        _expand(nodes, part, [])
        mtp_parts.append(tuple(part))  # type: ignore[arg-type]  # MTP parts hold no groups
    check_mtp_parts(pattern, mtp_parts)
    parsed = make_parsed_pattern(
        pattern, segments, positions, mtp_parts[0] if mtp_parts else (), len(mtp_parts)
    )
    check_attention_family(pattern, set(parsed.canonical))
    return parsed

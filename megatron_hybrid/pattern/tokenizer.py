"""Tokenizer for hybrid layer patterns, including repetition counts ``{N}``.

Tokens are literals (runs of layer symbols and well-formed groups), repetitions ``{N}`` and the
single characters ``[ ] ( ) | /``. Reading a run such as ``M[*E]-[*E]`` as one token keeps long
written-out patterns fast; a repetition binds to the last element of a run only, so that element
gets a token of its own. The layer symbols come from the layer-type table
(:mod:`megatron_hybrid.pattern.layer_types`), so a registered type's symbol is a token like the
built-in ones. Counts are checked here (no ``{}``, ``{0}`` or leading zeros) and
saturate at 10**15, far above any valid size, so the parser's size arithmetic stays O(1).
Malformed input becomes an ``INVALID`` token carrying its :class:`HybridPatternError`, which the
parser raises when it reaches it, so errors come in the order the parser meets them.

>>> [(t.text, t.count) for t in tokenize("(M*){3}E{99999999999999999999}")][-3:]
[('E', 0), ('{99999999999999999999}', 1000000000000000), ('', 0)]
>>> tokenize("E{03}")[1].error.message
'repetition count 03 at position 2 has a leading zero'
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from megatron_hybrid.pattern.errors import HybridPatternError, display_char
from megatron_hybrid.pattern.layer_types import SLOT_OF_SYMBOL, alphabet_version, layer_symbols
from megatron_hybrid.pattern.layout import Item
from megatron_hybrid.pattern.symbols import (
    GROUP_CLOSE,
    GROUP_OPEN,
    MTP_SEPARATOR,
    PIPE,
    REPEAT_CLOSE,
    REPEAT_OPEN,
    RUN_CLOSE,
    RUN_OPEN,
    Slot,
)

__all__ = [
    "COUNT_CAP",
    "END",
    "GROUP_END",
    "GROUP_START",
    "INVALID",
    "LITERAL",
    "Lexicon",
    "MTP_SEP",
    "REPEAT",
    "RUN_END",
    "RUN_START",
    "SEGMENT_SEP",
    "Token",
    "lexicon",
    "read_literal",
    "tokenize",
]

# Token kinds.
(
    LITERAL,
    GROUP_START,
    GROUP_END,
    RUN_START,
    RUN_END,
    REPEAT,
    SEGMENT_SEP,
    MTP_SEP,
    END,
    INVALID,
) = range(10)
_STRUCTURE_KINDS = {
    GROUP_OPEN: GROUP_START,
    GROUP_CLOSE: GROUP_END,
    RUN_OPEN: RUN_START,
    RUN_CLOSE: RUN_END,
    PIPE: SEGMENT_SEP,
    MTP_SEPARATOR: MTP_SEP,
}
_DIGITS = re.compile(r"[0-9]*")
# Counts saturate at COUNT_CAP: far above the limit (so messages can say how far above it a pattern
# goes), yet small enough to keep the size arithmetic O(1) however many digits or nested
# repetitions a pattern has.
COUNT_CAP = 10**15
_MAX_COUNT_DIGITS = len(str(COUNT_CAP))


class Lexicon(NamedTuple):
    """What the tokenizer derives from the alphabet (rebuilt when a layer type is registered).

    Attributes:
        symbols: the layer symbols.
        single_char_kinds: character -> token kind for symbols and structure characters.
        element: one symbol or one well-formed group.
        literal: a run of elements.
        expected: the "expected" text of an invalid-character error.
    """

    symbols: tuple[str, ...]
    single_char_kinds: dict[str, int]
    element: re.Pattern
    literal: re.Pattern
    expected: str


@functools.lru_cache(maxsize=4)
def _lexicon_for(version: int) -> Lexicon:
    symbols = layer_symbols()
    symbol_class = "[" + re.escape("".join(symbols)) + "]"
    element = re.compile(
        f"{re.escape(GROUP_OPEN)}{symbol_class}+{re.escape(GROUP_CLOSE)}|{symbol_class}"
    )
    return Lexicon(
        symbols=symbols,
        single_char_kinds={symbol: LITERAL for symbol in symbols} | _STRUCTURE_KINDS,
        element=element,
        literal=re.compile(f"(?:{element.pattern})+"),
        expected=f"a layer symbol ({' '.join(symbols)}) or one of [ ] ( ) {{ }} | /",
    )


def lexicon() -> Lexicon:
    """The lexicon of the current alphabet."""
    return _lexicon_for(alphabet_version())


class Token(NamedTuple):
    """One token: a literal (symbols and whole groups), a repetition ``{N}`` or one character.

    Attributes:
        kind: Token kind (module constants ``LITERAL`` ... ``INVALID``).
        position: Index of its first character in the pattern.
        text: The characters it covers.
        count: For ``REPEAT``, the count (saturated at 10**15).
        error: For ``INVALID``, the error to raise when the parser reaches it.
    """

    kind: int
    position: int
    text: str
    count: int = 0
    error: HybridPatternError | None = None


def tokenize(pattern: str) -> list[Token]:
    """Split ``pattern`` into tokens, ending with ``END``.

    Tokenizing stops at the first character that cannot start a token and emits an ``INVALID``
    token for it, so that errors are raised in the order the parser meets them.

    >>> [t.text for t in tokenize("[*E]{12}M[*-]*E{3}[*")]
    ['[*E]', '{12}', 'M[*-]*', 'E', '{3}', '[', '*', '']
    """
    lex = lexicon()
    tokens: list[Token] = []
    position, length = 0, len(pattern)
    while position < length:
        char = pattern[position]
        kind = lex.single_char_kinds.get(char)
        match = lex.literal.match(pattern, position) if kind in (LITERAL, GROUP_START) else None
        if match:
            # One token per run of symbols and well-formed groups keeps long literal patterns
            # fast. A repetition binds to the last element only: it gets a token of its own.
            end = match.end()
            if end < length and pattern[end] == REPEAT_OPEN:
                ends_with_group = pattern[end - 1] == GROUP_CLOSE
                last = pattern.rfind(GROUP_OPEN, position, end) if ends_with_group else end - 1
                if last > position:
                    tokens.append(Token(LITERAL, position, pattern[position:last]))
                    position = last
            tokens.append(Token(LITERAL, position, pattern[position:end]))
            position = end
        elif kind is not None:
            tokens.append(Token(kind, position, char))
            position += 1
        elif char == REPEAT_OPEN:
            token = _repeat_token(pattern, position)
            tokens.append(token)
            if token.kind == INVALID:
                break
            position += len(token.text)
        else:
            error = _invalid_char(pattern, position, lex)
            tokens.append(Token(INVALID, position, char, error=error))
            break
    tokens.append(Token(END, length, ""))
    return tokens


def _repeat_token(pattern: str, start: int) -> Token:
    """Read ``{N}`` at ``start``; an ``INVALID`` token when it is malformed."""

    def invalid(position: int, message: str, expected: str, hint: str | None = None) -> Token:
        error = HybridPatternError(message, pattern, position, expected, hint)
        return Token(INVALID, position, pattern[position : position + 1], error=error)

    digits_end = _DIGITS.match(pattern, start + 1).end()  # type: ignore[union-attr]
    digits = pattern[start + 1 : digits_end]
    example = "write the count between braces, e.g. '[*E]{4}'"
    if digits_end >= len(pattern):
        return invalid(
            start, f"'{{' at position {start} is never closed", "'N}' after '{'", example
        )
    after = pattern[digits_end]
    if not digits:
        what = (
            "empty repetition count '{}'" if after == REPEAT_CLOSE else "invalid repetition count"
        )
        return invalid(digits_end, f"{what} at position {digits_end}", "a number >= 1", example)
    if after != REPEAT_CLOSE:
        return invalid(
            digits_end,
            f"'{display_char(after)}' at position {digits_end} ends the repetition count",
            "'}' right after the digits",
            example,
        )
    if digits.strip("0") == "":
        return invalid(
            start + 1,
            f"repetition count {digits} at position {start + 1} repeats nothing",
            "a count >= 1",
            "remove the item to leave it out, or write {1} or more",
        )
    if digits[0] == "0":
        return invalid(
            start + 1,
            f"repetition count {digits} at position {start + 1} has a leading zero",
            "a decimal number without leading zeros",
            f"write {{{digits.lstrip('0')}}}",
        )
    count = int(digits) if len(digits) <= _MAX_COUNT_DIGITS else COUNT_CAP
    return Token(REPEAT, start, pattern[start : digits_end + 1], min(count, COUNT_CAP))


def _invalid_char(pattern: str, position: int, lex: Lexicon) -> HybridPatternError:
    char = pattern[position]
    shown = f"'{display_char(char)}'"
    message = f"invalid character {shown} at position {position}"
    hint = None
    if char.isspace():
        message = f"whitespace {shown} at position {position} is not allowed"
        hint = "remove the whitespace"
    elif char.upper() in lex.symbols:
        hint = f"layer symbols are upper case: write '{char.upper()}'"
    elif char == REPEAT_CLOSE:
        message = f"'}}' at position {position} closes a repetition count that was not opened"
        hint = "remove the '}' or open the count with '{', e.g. 'M{2}'"
    elif char.isdigit() or char in "xX":
        hint = "repeat a unit with {N} right after it, e.g. '[*E]{4}' or '(M*){3}'"
    return HybridPatternError(message, pattern, position, lex.expected, hint)


@functools.lru_cache(maxsize=256)
def _follows_slot_rules(members: str, version: int) -> bool:
    """At most one member per slot, the MLP-slot member last (cached: groups repeat a lot).

    ``version`` is the alphabet version: a cache key, so a re-registered symbol is re-read.
    """
    slots = [SLOT_OF_SYMBOL[symbol] for symbol in members]
    return len(set(slots)) == len(slots) and Slot.MLP not in slots[:-1]


#: Longest literal kept in the cache below: repeated short literals are the common case, and
#: caching long ones would keep the text of rejected patterns alive.
_CACHED_LITERAL_LENGTH = 256


def read_literal(text: str) -> tuple[tuple[Item, ...], tuple[int, ...], int] | None:
    """Items of a literal token, their offsets in it and its physical count; None if a group
    breaks a slot rule (at most one member per slot, the MLP-slot member last), which the parser
    then finds and reports with its position."""
    version = alphabet_version()
    if len(text) <= _CACHED_LITERAL_LENGTH:
        return _read_short_literal(text, version)
    return _read_literal_uncached(text, version)


@functools.lru_cache(maxsize=256)
def _read_short_literal(
    text: str, version: int
) -> tuple[tuple[Item, ...], tuple[int, ...], int] | None:
    return _read_literal_uncached(text, version)


def _read_literal_uncached(
    text: str, version: int
) -> tuple[tuple[Item, ...], tuple[int, ...], int] | None:
    items: list[Item] = []
    offsets: list[int] = []
    for match in lexicon().element.finditer(text):
        element = match.group()
        if element[0] == GROUP_OPEN:
            members = element[1:-1]
            if not _follows_slot_rules(members, version):
                return None
            items.append(tuple(members))
        else:
            items.append(element)
        offsets.append(match.start())
    return tuple(items), tuple(offsets), len(text) - 2 * text.count(GROUP_OPEN)

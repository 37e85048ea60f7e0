"""The characters of hybrid layer patterns: built-in layer symbols, slots and separators.

The facts about each layer type (name, slot, GPT role, THD rule, colour) live in one table,
:mod:`megatron_hybrid.pattern.layer_types`, which also takes registrations of new types; this
module holds the characters the table and the parser are written with (``SYMBOL_NAMES`` and
``SLOT_OF_SYMBOL`` are views of that table: import them from it, or from
:mod:`megatron_hybrid.pattern`). Vocabulary used across the package:

* *layer* (or *physical layer*): one symbol, one module with its own ``layer_number``;
* *group*: ``[...]``, several physical layers that form one Transformer-equivalent layer;
* *logical layer*: a top-level item after expansion (a plain symbol or a whole group);
* *segment*: the layers between two ``|``, one pipeline (virtual) stage;
* *global index*: the position in the flattened main pattern, across all segments.

>>> SYMBOLS
('M', 'G', '*', 'D', '+', '-', 'E')
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ATTENTION",
    "DSA",
    "GDN",
    "GRAMMAR_VERSION",
    "GROUP_CLOSE",
    "GROUP_OPEN",
    "MAMBA",
    "MAX_NESTING_DEPTH",
    "MAX_PATTERN_LENGTH",
    "MAX_PHYSICAL_LAYERS",
    "MLA",
    "MLP",
    "MOE",
    "MTP_SEPARATOR",
    "PIPE",
    "REPEAT_CLOSE",
    "REPEAT_OPEN",
    "RUN_CLOSE",
    "RUN_OPEN",
    "SYMBOLS",
    "Slot",
]

# Layer symbols (the same characters megatron-core's hybrid_layer_allocation.Symbols uses).
MAMBA = "M"
GDN = "G"
ATTENTION = "*"
DSA = "D"
MLA = "+"
MLP = "-"
MOE = "E"

#: The built-in layer symbols, in table order. Types registered later are in
#: ``megatron_hybrid.pattern.layer_types.layer_symbols()``, which the parser reads.
SYMBOLS: tuple[str, ...] = (MAMBA, GDN, ATTENTION, DSA, MLA, MLP, MOE)

# Structure characters.
PIPE = "|"
MTP_SEPARATOR = "/"
GROUP_OPEN = "["
GROUP_CLOSE = "]"
RUN_OPEN = "("
RUN_CLOSE = ")"
REPEAT_OPEN = "{"
REPEAT_CLOSE = "}"


class Slot(StrEnum):
    """The place a layer takes inside a Transformer-equivalent group.

    A group holds at most one layer per slot, so its members map one-to-one onto the submodules
    of a GPT layer (and onto distinct checkpoint keys).
    """

    MIXER = "mixer"
    ATTENTION = "attention"
    MLP = "mlp"


#: Largest number of physical layers a pattern may expand to (main plus every MTP depth). It
#: catches typos such as ``{50000}`` for ``{50}`` before anything is expanded.
MAX_PHYSICAL_LAYERS = 100_000

#: Longest pattern text accepted. Repetition counts keep real patterns short; the bound stops a
#: runaway string (say ten million '|') before it is tokenised.
MAX_PATTERN_LENGTH = 200_000

#: Deepest nesting of parentheses; real patterns need two or three levels, and the bound keeps the
#: recursive-descent parser far from Python's recursion limit.
MAX_NESTING_DEPTH = 32

#: Version of the grammar; bumped on any change to what a pattern string means.
GRAMMAR_VERSION = 1

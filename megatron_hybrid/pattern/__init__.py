"""Hybrid layer patterns: grammar, errors and pipeline layout, in pure Python (no torch).

>>> from megatron_hybrid.pattern import parse_pattern, select_pipeline_segment
>>> p = parse_pattern("[*-]{2}|[*E]{2}/*E")
>>> p.canonical, p.physical_layer_count, p.logical_layer_count
('[*-][*-]|[*E][*E]/*E', 8, 4)
>>> select_pipeline_segment(p, pp_rank=1, pp_size=2).physical_offset
4

See ``docs/pattern_grammar.md`` for the grammar, every error and the differences from
megatron-core's ``--hybrid-layer-pattern``.
"""

from megatron_hybrid.pattern.errors import HybridPatternError
from megatron_hybrid.pattern.grammar import parse_pattern
from megatron_hybrid.pattern.layout import (
    Item,
    LogicalLayer,
    ParsedPattern,
    flatten_items,
    item_physical_count,
    item_to_str,
    items_to_str,
)
from megatron_hybrid.pattern.pipeline import (
    PipelineSelection,
    pipeline_segments,
    select_pipeline_segment,
    virtual_stages,
    with_option_names,
)
from megatron_hybrid.pattern.symbols import (
    ATTENTION,
    DSA,
    GDN,
    GRAMMAR_VERSION,
    MAMBA,
    MAX_NESTING_DEPTH,
    MAX_PATTERN_LENGTH,
    MAX_PHYSICAL_LAYERS,
    MLA,
    MLP,
    MOE,
    MTP_SEPARATOR,
    PIPE,
    SLOT_OF_SYMBOL,
    SYMBOL_NAMES,
    SYMBOLS,
    Slot,
)

# The public surface; the tokenizer (tokenizer.py) and parse-tree nodes (grammar.py) stay internal.
__all__ = [
    "ATTENTION",
    "DSA",
    "GDN",
    "GRAMMAR_VERSION",
    "MAMBA",
    "MAX_NESTING_DEPTH",
    "MAX_PATTERN_LENGTH",
    "MAX_PHYSICAL_LAYERS",
    "MLA",
    "MLP",
    "MOE",
    "MTP_SEPARATOR",
    "PIPE",
    "SLOT_OF_SYMBOL",
    "SYMBOLS",
    "SYMBOL_NAMES",
    "HybridPatternError",
    "Item",
    "LogicalLayer",
    "ParsedPattern",
    "PipelineSelection",
    "Slot",
    "flatten_items",
    "item_physical_count",
    "item_to_str",
    "items_to_str",
    "parse_pattern",
    "pipeline_segments",
    "with_option_names",
    "select_pipeline_segment",
    "virtual_stages",
]

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
from megatron_hybrid.pattern.layer_types import (
    LAYER_TYPES,
    SLOT_OF_SYMBOL,
    SYMBOL_NAMES,
    GptRole,
    LayerTypeFacts,
    alphabet_version,
    layer_facts,
    layer_symbols,
    register_layer_facts,
    unregister_layer_facts,
)
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
    with_stages,
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
    SYMBOLS,
    Slot,
)
from megatron_hybrid.pattern.thd_rules import ThdOptions, accepts_thd

# The public surface; the tokenizer (tokenizer.py) and parse-tree nodes (grammar.py) stay internal.
__all__ = [
    "ATTENTION",
    "DSA",
    "GDN",
    "GRAMMAR_VERSION",
    "LAYER_TYPES",
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
    "GptRole",
    "HybridPatternError",
    "Item",
    "LayerTypeFacts",
    "LogicalLayer",
    "ParsedPattern",
    "PipelineSelection",
    "Slot",
    "ThdOptions",
    "accepts_thd",
    "alphabet_version",
    "flatten_items",
    "item_physical_count",
    "item_to_str",
    "items_to_str",
    "layer_facts",
    "layer_symbols",
    "parse_pattern",
    "pipeline_segments",
    "register_layer_facts",
    "select_pipeline_segment",
    "unregister_layer_facts",
    "with_option_names",
    "virtual_stages",
    "with_stages",
]

"""The pattern package is pure Python: importing it (and describe's key rules) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import megatron_hybrid.pattern as pattern


def test_pattern_imports_without_torch_or_megatron():
    code = (
        "import sys\n"
        "import megatron_hybrid.pattern, megatron_hybrid.checkpointing.keys\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_names():
    assert set(pattern.__all__) >= {
        "parse_pattern",
        "select_pipeline_segment",
        "pipeline_segments",
        "HybridPatternError",
        "ParsedPattern",
        "LogicalLayer",
        "PipelineSelection",
        "flatten_items",
        "item_physical_count",
        "item_to_str",
        "items_to_str",
        "SLOT_OF_SYMBOL",
        "MAX_PHYSICAL_LAYERS",
        "MAMBA",
        "GDN",
        "ATTENTION",
        "DSA",
        "MLA",
        "MLP",
        "MOE",
    }
    assert all(hasattr(pattern, name) for name in pattern.__all__)
    assert (pattern.MAMBA, pattern.GDN, pattern.ATTENTION, pattern.DSA) == ("M", "G", "*", "D")
    assert (pattern.MLA, pattern.MLP, pattern.MOE) == ("+", "-", "E")


def test_slots():
    slot = pattern.SLOT_OF_SYMBOL
    assert set(slot) == set(pattern.SYMBOLS)
    assert {s for s in slot if slot[s] == pattern.Slot.MIXER} == {"M"}
    assert {s for s in slot if slot[s] == pattern.Slot.ATTENTION} == {"*", "D", "+", "G"}
    assert {s for s in slot if slot[s] == pattern.Slot.MLP} == {"-", "E"}

"""Patterns the grammar accepts: canonical form, segments, counts, logical layers, MTP."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hybrid.pattern import (
    GRAMMAR_VERSION,
    MAX_PHYSICAL_LAYERS,
    LogicalLayer,
    ParsedPattern,
    flatten_items,
    parse_pattern,
)

# (pattern, canonical, physical, logical, segments, mtp_pattern, mtp_depths)
VALID = [
    # megatron-core patterns keep their meaning: canonical == input
    ("M", "M", 1, 1, 1, None, 0),
    ("E", "E", 1, 1, 1, None, 0),
    ("M*M*", "M*M*", 4, 4, 1, None, 0),
    ("M-M*-", "M-M*-", 5, 5, 1, None, 0),
    ("G-G-", "G-G-", 4, 4, 1, None, 0),
    ("DE+-", "DE+-", 4, 4, 1, None, 0),
    ("MMMM/*M/*M/*M", "MMMM/*M/*M/*M", 4, 4, 1, "*M", 3),
    ("M-M-|M-M*-/MM/MM", "M-M-|M-M*-/MM/MM", 9, 9, 2, "MM", 2),
    ("M|", "M|", 1, 1, 2, None, 0),
    # empty MTP parts are dropped, as upstream
    ("*E/", "*E", 2, 2, 1, None, 0),
    ("*E//", "*E", 2, 2, 1, None, 0),
    ("M*M*/", "M*M*", 4, 4, 1, None, 0),
    # empty main with MTP, empty segments
    ("/*E", "/*E", 0, 0, 1, "*E", 1),
    ("|/*E", "|/*E", 0, 0, 2, "*E", 1),
    ("[*E]|", "[*E]|", 2, 1, 2, None, 0),
    ("|[*E]", "|[*E]", 2, 1, 2, None, 0),
    ("[*E]||[*E]", "[*E]||[*E]", 4, 2, 3, None, 0),
    # groups (one member per slot, MLP-slot member last)
    ("[*-]", "[*-]", 2, 1, 1, None, 0),
    ("[*E]", "[*E]", 2, 1, 1, None, 0),
    ("[GE]", "[GE]", 2, 1, 1, None, 0),
    ("[M*E]", "[M*E]", 3, 1, 1, None, 0),
    ("[*ME]", "[*ME]", 3, 1, 1, None, 0),
    ("[MG]", "[MG]", 2, 1, 1, None, 0),
    ("[+E]", "[+E]", 2, 1, 1, None, 0),
    ("[DE]", "[DE]", 2, 1, 1, None, 0),
    ("[M+-]", "[M+-]", 3, 1, 1, None, 0),
    ("[E]", "[E]", 1, 1, 1, None, 0),
    ("[*]", "[*]", 1, 1, 1, None, 0),
    ("M[M*]-", "M[M*]-", 4, 3, 1, None, 0),
    # repetition of symbols, groups and parenthesised runs
    ("M{1}", "M", 1, 1, 1, None, 0),
    ("M{3}", "MMM", 3, 3, 1, None, 0),
    ("M*{3}", "M***", 4, 4, 1, None, 0),
    ("(M){3}", "MMM", 3, 3, 1, None, 0),
    ("(M*){2}E", "M*M*E", 5, 5, 1, None, 0),
    ("(M-M*-){4}", "M-M*-" * 4, 20, 20, 1, None, 0),
    ("((M*){2}-){2}", "M*M*-M*M*-", 10, 10, 1, None, 0),
    ("([*E]M){2}", "[*E]M[*E]M", 6, 4, 1, None, 0),
    ("([GE]){2}", "[GE][GE]", 4, 2, 1, None, 0),
    ("[*-]{3}[*E]{58}", "[*-]" * 3 + "[*E]" * 58, 122, 61, 1, None, 0),
    ("[GE]{3}[*E]", "[GE][GE][GE][*E]", 8, 4, 1, None, 0),
    ("[*E]{4}|[*E]{4}/*E", "[*E]" * 4 + "|" + "[*E]" * 4 + "/*E", 16, 8, 2, "*E", 1),
    ("[*-]{2}|[*E]{2}/*E", "[*-][*-]|[*E][*E]/*E", 8, 4, 2, "*E", 1),
    ("M{10}|M{10}", "M" * 10 + "|" + "M" * 10, 20, 20, 2, None, 0),
    # MTP parts may use repetition; they are compared after expansion
    ("(*E){2}/(*E){1}", "*E*E/*E", 4, 4, 1, "*E", 1),
    ("M/M{2}/MM", "M/MM/MM", 1, 1, 1, "MM", 2),
    ("*E/*E{1}", "*E/*E", 2, 2, 1, "*E", 1),
    # the size limit counts main plus every MTP depth and is inclusive
    ("[*E]{50000}", "[*E]" * 50000, 100_000, 50_000, 1, None, 0),
    ("*{99999}/*", "*" * 99999 + "/*", 99_999, 99_999, 1, "*", 1),
]


@pytest.mark.parametrize(
    ("pattern", "canonical", "physical", "logical", "segments", "mtp", "depths"),
    VALID,
    ids=[case[0][:30] for case in VALID],
)
def test_valid_pattern(pattern, canonical, physical, logical, segments, mtp, depths):
    p = parse_pattern(pattern)
    assert p.pattern == pattern
    assert p.canonical == canonical
    assert p.physical_layer_count == physical
    assert p.logical_layer_count == logical
    assert p.num_segments == segments
    assert p.mtp_pattern == mtp
    assert p.mtp_num_depths == depths
    assert p.main_pattern == canonical.split("/")[0]
    assert p.has_groups == ("[" in p.main_pattern)
    assert set(p.canonical) <= set("MG*D+-E[]|/")


def test_design_example():
    p = parse_pattern("[*-]{2}|[*E]{2}/*E")
    assert p.segments == ((("*", "-"), ("*", "-")), (("*", "E"), ("*", "E")))
    assert p.items == (("*", "-"), ("*", "-"), ("*", "E"), ("*", "E"))
    assert p.mtp_items == ("*", "E")
    assert p.layer_counts == {"M": 0, "G": 0, "*": 5, "D": 0, "+": 0, "-": 2, "E": 3}
    assert p.version == GRAMMAR_VERSION == 1


def test_items_mix_symbols_and_groups():
    assert parse_pattern("M[M*]-").items == ("M", ("M", "*"), "-")
    assert parse_pattern("[E]").items == (("E",),)


def test_logical_layers():
    p = parse_pattern("M[*E]{2}|-")
    assert p.logical_layers == (
        LogicalLayer(0, ("M",), (1,), 0, False, 0),
        LogicalLayer(1, ("*", "E"), (2, 3), 0, True, 1),
        LogicalLayer(2, ("*", "E"), (4, 5), 0, True, 1),
        LogicalLayer(3, ("-",), (6,), 1, False, 9),
    )
    assert [layer.item for layer in p.logical_layers] == list(p.items)


def test_layer_counts_count_mtp_once_per_depth():
    counts = parse_pattern("M[*E]M/*E/*E").layer_counts
    assert counts == {"M": 2, "G": 0, "*": 3, "D": 0, "+": 0, "-": 0, "E": 3}
    assert list(counts) == ["M", "G", "*", "D", "+", "-", "E"]


def test_layer_counts_are_a_fresh_dict():
    p = parse_pattern("[*E]{2}")
    p.layer_counts["E"] = 99
    assert p.layer_counts["E"] == 2


def test_result_is_frozen_and_cached():
    p = parse_pattern("[*E]{3}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.pattern = "M"  # type: ignore[misc]
    assert parse_pattern("[*E]{3}") is p
    assert parse_pattern(p) is p
    assert hash(p) == hash(parse_pattern("[*E]{3}"))


def test_equal_meaning_different_text():
    a, b = parse_pattern("[*E]{2}"), parse_pattern("[*E][*E]")
    assert a.canonical == b.canonical and a.segments == b.segments
    assert a != b  # the typed pattern is part of the result


def test_limit_constant():
    assert MAX_PHYSICAL_LAYERS == 100_000
    p = parse_pattern("*{50000}/*{25000}/*{25000}")
    assert p.physical_layer_count + p.mtp_num_depths * len(p.mtp_items) == MAX_PHYSICAL_LAYERS


@pytest.mark.parametrize("value", [None, 3, b"M*"], ids=["none", "int", "bytes"])
def test_non_string_is_type_error(value):
    with pytest.raises(TypeError, match="must be a str"):
        parse_pattern(value)


def test_flatten_matches_canonical():
    p = parse_pattern("(M[*E]-){3}")
    assert "".join(flatten_items(p.items)) == p.canonical.replace("[", "").replace("]", "")
    assert isinstance(p, ParsedPattern)


@pytest.mark.parametrize(
    ("pattern", "flat"),
    [
        ("[*-]{2}|[*E]{2}/*E", "*-*-|*E*E/*E"),
        ("(M[*E]-){2}", "M*E-M*E-"),
        ("M*-", "M*-"),
        ("[GE]{2}/*E/*E", "GEGE/*E/*E"),
    ],
    ids=["pipes-and-mtp", "runs", "no-groups", "two-mtp-depths"],
)
def test_flat_form_opens_groups_and_keeps_the_layers(pattern, flat):
    p = parse_pattern(pattern)
    assert p.flat == flat
    q = parse_pattern(p.flat)  # megatron-core's grammar: no groups, the same layers
    assert not q.has_groups and q.physical_layer_count == p.physical_layer_count
    assert q.num_segments == p.num_segments and q.mtp_num_depths == p.mtp_num_depths

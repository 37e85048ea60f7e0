"""Pipeline (virtual) stage selection: '|' segments, automatic splits, offsets and errors."""

from __future__ import annotations

import pytest

from megatron_hybrid.pattern import (
    HybridPatternError,
    items_to_str,
    parse_pattern,
    pipeline_segments,
    select_pipeline_segment,
)

# (pattern, pp_rank, pp_size, vp_stage, first, last) -> (items, physical_offset, logical_offset)
SELECTIONS = [
    # '|' segments: segment vp_stage * pp_size + pp_rank
    ("[*-]{2}|[*E]{2}/*E", 0, 2, None, None, None, "[*-][*-]", 0, 0),
    ("[*-]{2}|[*E]{2}/*E", 1, 2, None, None, None, "[*E][*E]", 4, 2),
    ("[M*E]|M-", 0, 1, 1, None, None, "M-", 3, 1),
    ("[*-][*-]|[*E][*E]", 0, 1, 1, None, None, "[*E][*E]", 4, 2),
    ("[*-]|[*-]|[*E]|[*E]/*E", 0, 2, 1, None, None, "[*E]", 4, 2),
    ("[*-]|[*-]|[*E]|[*E]/*E", 1, 2, 1, None, None, "[*E]", 6, 3),
    ("[*E]||[*E]|", 1, 2, 0, None, None, "", 2, 1),
    ("[*E]||[*E]|", 0, 2, 1, None, None, "[*E]", 2, 1),
    ("[*E]||[*E]|", 1, 2, 1, None, None, "", 4, 2),
    ("M|*", 0, 1, None, None, None, "M", 0, 0),
    # no '|': the whole pattern, or an equal split by physical layers
    ("[*E]{3}M", 0, 1, None, None, None, "[*E][*E][*E]M", 0, 0),
    ("[*E]{3}M", 0, 1, 0, None, None, "[*E][*E][*E]M", 0, 0),
    ("M*M*M*", 1, 3, None, None, None, "M*", 2, 2),
    ("[*-]{2}[*E]{2}", 1, 2, None, None, None, "[*E][*E]", 4, 2),
    ("M[*E]M[*E]", 1, 2, None, None, None, "M[*E]", 3, 2),
    ("/*E", 1, 2, None, None, None, "", 0, 0),
    # first/last stage layer counts (physical), the rest equal
    ("[*E]{5}", 0, 3, None, 2, None, "[*E]", 0, 0),
    ("[*E]{5}", 1, 3, None, 2, None, "[*E][*E]", 2, 1),
    ("[*E]{5}", 2, 3, None, 2, None, "[*E][*E]", 6, 3),
    ("M{7}", 3, 4, None, None, 1, "M", 6, 6),
    ("M{7}", 0, 4, None, None, 1, "MM", 0, 0),
    ("M{8}", 1, 3, None, 1, 1, "M" * 6, 1, 1),
    ("M{8}", 1, 2, None, 3, 5, "M" * 5, 3, 3),
    ("M{4}", 0, 3, None, 0, None, "", 0, 0),
]


@pytest.mark.parametrize(
    ("pattern", "rank", "size", "vp", "first", "last", "items", "physical", "logical"),
    SELECTIONS,
    ids=[f"{c[0]}-r{c[1]}of{c[2]}-vp{c[3]}-f{c[4]}-l{c[5]}" for c in SELECTIONS],
)
def test_selection(pattern, rank, size, vp, first, last, items, physical, logical):
    sel = select_pipeline_segment(pattern, rank, size, vp, first, last)
    assert items_to_str(sel.items) == items
    assert (sel.physical_offset, sel.logical_offset) == (physical, logical)
    assert sel.logical_layer_count == len(sel.items)
    assert (sel.pp_rank, sel.pp_size) == (rank, size)
    assert (sel.segment_index is None) == (parse_pattern(pattern).num_segments == 1)


def test_selection_accepts_parsed_pattern_and_keywords():
    p = parse_pattern("[*-]{2}|[*E]{2}/*E")
    sel = select_pipeline_segment(
        p, pp_rank=1, pp_size=2, vp_stage=None, first_stage_layers=None, last_stage_layers=None
    )
    assert sel.items == (("*", "E"), ("*", "E"))
    assert (sel.physical_offset, sel.logical_offset, sel.segment_index) == (4, 2, 1)
    assert (sel.physical_layer_count, sel.logical_layer_count, sel.vp_stage) == (4, 2, 0)


def test_pipeline_segments_order_is_layer_order():
    stages = pipeline_segments("M|*|-|E|G|M", 2)
    assert [(s.pp_rank, s.vp_stage, s.segment_index) for s in stages] == [
        (0, 0, 0),
        (1, 0, 1),
        (0, 1, 2),
        (1, 1, 3),
        (0, 2, 4),
        (1, 2, 5),
    ]
    assert "".join(items_to_str(s.items) for s in stages) == "M*-EGM"


def test_group_cut_names_the_group_and_suggests_pipes():
    with pytest.raises(HybridPatternError, match="cuts logical layer 2") as info:
        select_pipeline_segment("-[M*E]{3}", 0, 2)
    error = info.value
    assert error.position == 1  # the '[' of the repeated group
    assert "between physical layers 5 and 6" in error.message
    assert error.hint is not None and "'-[M*E]|[M*E][M*E]'" in error.hint
    assert "^" in str(error)


def test_group_cut_by_first_stage_layers():
    with pytest.raises(HybridPatternError, match="stages of 3/4/4") as info:
        select_pipeline_segment("[*E]{5}M", 2, 3, first_stage_layers=3)
    assert info.value.position == 0


def test_group_cut_is_raised_on_every_rank():
    # the cut is between the stages of ranks 1 and 2; rank 0 must refuse too
    for rank in range(3):
        with pytest.raises(HybridPatternError, match="cuts logical layer"):
            select_pipeline_segment("M{5}[*E]MM", rank, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(pattern="M*", pp_rank=0, pp_size=0), "pp_size must be an integer >= 1, got 0"),
        (dict(pattern="M*", pp_rank=-1, pp_size=2), "pp_rank must be an integer >= 0, got -1"),
        (dict(pattern="M*", pp_rank=2, pp_size=2), r"pp_rank \(2\) must be < pp_size \(2\)"),
        (dict(pattern="M*", pp_rank=True, pp_size=2), "pp_rank must be an integer >= 0, got True"),
        (dict(pattern="M*", pp_rank=0, pp_size=2.0), r"pp_size must be an integer >= 1, got 2\.0"),
        (
            dict(pattern="M*", pp_rank=0, pp_size=1, vp_stage=-1),
            "vp_stage must be an integer >= 0, got -1",
        ),
        (dict(pattern="M*", pp_rank=0, pp_size=2, first_stage_layers=-1), "first_stage_layers"),
        (
            dict(pattern="M|*|-", pp_rank=0, pp_size=2),
            r"3 '\|'-separated segments, which is not a multiple of pp_size 2",
        ),
        (dict(pattern="M|*", pp_rank=0, pp_size=1, vp_stage=2), r"vp_stage \(2\) must be < 2"),
        (dict(pattern="M|*", pp_rank=0, pp_size=2, vp_stage=1), r"vp_stage \(1\) must be < 1"),
        (dict(pattern="M|*", pp_rank=0, pp_size=2, first_stage_layers=1), "already define"),
        (dict(pattern="M|*", pp_rank=0, pp_size=2, last_stage_layers=1), "already define"),
        (dict(pattern="M*M", pp_rank=0, pp_size=2), r"must divide the 3 physical layers"),
        (dict(pattern="M*M*", pp_rank=0, pp_size=2, vp_stage=1), "needs '|'"),
        (dict(pattern="M*M*", pp_rank=0, pp_size=1, first_stage_layers=1), "pp_size > 1"),
        (dict(pattern="M{5}", pp_rank=0, pp_size=3, first_stage_layers=2), "split equally"),
        (dict(pattern="M{5}", pp_rank=0, pp_size=2, first_stage_layers=6), "do not fit"),
        (
            dict(pattern="M{5}", pp_rank=0, pp_size=2, first_stage_layers=2, last_stage_layers=2),
            "do not fit",
        ),
    ],
    ids=[
        "pp-size-zero",
        "negative-rank",
        "rank-too-large",
        "bool-rank",
        "float-size",
        "negative-vp",
        "negative-first",
        "segments-not-divisible",
        "vp-out-of-range",
        "vp-out-of-range-pp2",
        "first-with-pipes",
        "last-with-pipes",
        "layers-not-divisible",
        "vpp-without-pipes",
        "first-with-pp1",
        "middle-not-divisible",
        "first-too-large",
        "first-plus-last-short",
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        select_pipeline_segment(**kwargs)
    assert not isinstance(info.value, HybridPatternError)


def test_invalid_pattern_string_raises_pattern_error():
    with pytest.raises(HybridPatternError):
        select_pipeline_segment("[*E", 0, 1)


@pytest.mark.parametrize(
    ("values", "target"),
    [([0, 2, 4, 6], 3.0), ([0, 2, 4, 6], 3.5), ([0, 3, 9], -1.0), ([0, 3, 9], 100.0),
     ([0, 5], 2.5), ([0, 1, 2, 10, 11], 6.0), ([0], 0.0)],
)  # fmt: skip
def test_nearest_matches_a_linear_scan(values, target):
    from megatron_hybrid.pattern.pipeline import _nearest

    reference = min(range(len(values)), key=lambda i: abs(values[i] - target))
    assert _nearest(values, target) == reference


def test_pipe_hint_scales_to_thousands_of_stages():
    """[*E]{50000} over 4000 stages: the message stays short (and the hint is no longer
    O(stages x layers))."""
    with pytest.raises(HybridPatternError, match=r"stages of 4000 x 25 layers") as info:
        select_pipeline_segment("[*E]{50000}", 0, 4000)
    assert len(info.value.message) < 300
    assert info.value.hint is not None and "3999 '|'" in info.value.hint

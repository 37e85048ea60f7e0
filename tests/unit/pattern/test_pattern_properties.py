"""Property tests: any string parses or raises HybridPatternError; valid patterns round-trip,
expand as written, count consistently and split into pipeline stages that cover every layer."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from itertools import accumulate

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_hybrid.pattern import (
    HybridPatternError,
    flatten_items,
    item_physical_count,
    item_to_str,
    items_to_str,
    parse_pattern,
    pipeline_segments,
    select_pipeline_segment,
)

# Bounded examples keep the suite fast; the deadline flags a pathologically slow parse.
FAST = settings(
    max_examples=300,
    deadline=timedelta(seconds=2),
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Generating structured patterns costs more than parsing them: fewer examples.
STRUCTURED = settings(FAST, max_examples=100)

GRAMMAR_CHARS = list("MG*D+-E[](){}|/0123456789")
ALPHABET = GRAMMAR_CHARS + [" ", "\t", "x", "m", "\u00e9", ",", "\n"]


def check_invariants(p) -> None:
    """Relations every parse result satisfies."""
    again = parse_pattern(p.canonical)
    assert again.canonical == p.canonical
    assert again.segments == p.segments and again.mtp_items == p.mtp_items
    assert p.items == tuple(item for segment in p.segments for item in segment)
    physical = flatten_items(p.items)
    assert p.physical_layer_count == len(physical) == sum(map(item_physical_count, p.items))
    assert p.logical_layer_count == len(p.items)
    counts = Counter(physical)
    for symbol in p.mtp_items:
        counts[symbol] += p.mtp_num_depths
    assert {s: n for s, n in p.layer_counts.items() if n} == dict(counts)
    numbers = [n for layer in p.logical_layers for n in layer.layer_numbers]
    assert numbers == list(range(1, p.physical_layer_count + 1))
    assert [layer.index for layer in p.logical_layers] == list(range(p.logical_layer_count))
    segment_of = [i for i, segment in enumerate(p.segments) for _ in segment]
    assert [layer.segment for layer in p.logical_layers] == segment_of
    for layer in p.logical_layers:
        assert layer.is_group == isinstance(layer.item, tuple)
        assert p.pattern[layer.position] == ("[" if layer.is_group else layer.members[0])


@FAST
@given(st.text(alphabet=ALPHABET, max_size=40) | st.text(alphabet=GRAMMAR_CHARS, max_size=40))
def test_any_string_parses_or_raises_pattern_error(text):
    try:
        p = parse_pattern(text)
    except HybridPatternError as error:
        assert error.pattern == text
        assert error.position is None or 0 <= error.position <= len(text)
        assert str(error).splitlines()[0] == error.message
        return
    check_invariants(p)


# --- a generator of valid patterns that also returns their expected expansion -------------


def symbols(family: str) -> st.SearchStrategy[str]:
    # One attention family per model: '*' or MLA/DSA.
    return st.sampled_from(list("MG-E") + list(family))


@st.composite
def groups(draw, family: str) -> tuple[str, ...]:
    front = [
        symbol
        for symbol in (
            draw(st.sampled_from(["", "M"])),
            draw(st.sampled_from(["", "G", *family])),
        )
        if symbol
    ]
    if draw(st.booleans()):
        front.reverse()
    mlp = draw(st.sampled_from(["", "-", "E"]))
    members = tuple(front + ([mlp] if mlp else []))
    return members or ("E",)


def units(family: str, depth: int, allow_groups: bool) -> st.SearchStrategy:
    """(text, expansion) of one item; the expansion is a list of items."""
    plain = st.tuples(symbols(family), st.integers(1, 4)).map(
        lambda su: (su[0] + (f"{{{su[1]}}}" if su[1] > 1 else ""), [su[0]] * su[1])
    )
    options = [plain]
    if allow_groups:
        options.append(
            st.tuples(groups(family), st.integers(1, 3)).map(
                lambda gu: (
                    item_to_str(gu[0]) + (f"{{{gu[1]}}}" if gu[1] > 1 else ""),
                    [gu[0]] * gu[1],
                )
            )
        )
    if depth < 2:
        options.append(
            st.tuples(
                st.lists(units(family, depth + 1, allow_groups), min_size=1, max_size=3),
                st.integers(1, 3),
            ).map(
                lambda ru: (
                    "(" + "".join(t for t, _ in ru[0]) + f"){{{ru[1]}}}",
                    [i for _, e in ru[0] for i in e] * ru[1],
                )
            )
        )
    return st.one_of(options)


@st.composite
def valid_patterns(draw, min_segments: int = 1, max_segments: int = 4):
    """(pattern text, expected segments, expected MTP items, MTP depths)."""
    family = draw(st.sampled_from(["*", "D+"]))
    segments = draw(
        st.lists(
            st.lists(units(family, 0, True), max_size=4),
            min_size=min_segments,
            max_size=max_segments,
        )
    )
    mtp = draw(st.lists(units(family, 0, False), max_size=2))
    depths = draw(st.integers(0, 2)) if mtp else 0
    mtp_items = [i for _, e in mtp for i in e]
    expanded_mtp = "".join(mtp_items)
    # Write later depths either like the first or fully expanded: they compare after expansion.
    parts = [
        "".join(t for t, _ in mtp) if draw(st.booleans()) else expanded_mtp for _ in range(depths)
    ]
    text = "|".join("".join(t for t, _ in segment) for segment in segments)
    text += "".join("/" + part for part in parts)
    expected = tuple(tuple(i for _, e in segment for i in e) for segment in segments)
    assume(sum(map(len, expected)) + depths * len(mtp_items) > 0)
    return text, expected, tuple(mtp_items) if depths else (), depths


@STRUCTURED
@given(valid_patterns())
def test_repetition_equals_manual_expansion(case):
    text, segments, mtp_items, depths = case
    p = parse_pattern(text)
    assert p.segments == segments
    assert p.mtp_items == mtp_items and p.mtp_num_depths == depths
    expected = "|".join(items_to_str(s) for s in segments) + ("/" + "".join(mtp_items)) * depths
    assert p.canonical == expected


@STRUCTURED
@given(valid_patterns())
def test_canonical_round_trip_and_counts(case):
    p = parse_pattern(case[0])
    check_invariants(p)
    assert parse_pattern(p.canonical).canonical == p.canonical


@STRUCTURED
@given(valid_patterns(min_segments=2, max_segments=6), st.data())
def test_pipe_stages_cover_every_layer_once(case, data):
    p = parse_pattern(case[0])
    divisors = [n for n in range(1, p.num_segments + 1) if p.num_segments % n == 0]
    pp_size = data.draw(st.sampled_from(divisors), label="pp_size")
    stages = pipeline_segments(p, pp_size)
    assert len(stages) == p.num_segments
    assert tuple(item for s in stages for item in s.items) == p.items
    physical = list(accumulate((s.physical_layer_count for s in stages), initial=0))
    logical = list(accumulate((s.logical_layer_count for s in stages), initial=0))
    for i, s in enumerate(stages):
        assert (s.physical_offset, s.logical_offset, s.segment_index) == (
            physical[i],
            logical[i],
            i,
        )
        assert s == select_pipeline_segment(p.pattern, s.pp_rank, pp_size, s.vp_stage)
        assert i == s.vp_stage * pp_size + s.pp_rank
    assert physical[-1] == p.physical_layer_count and logical[-1] == p.logical_layer_count


@STRUCTURED
@given(valid_patterns(max_segments=1), st.integers(1, 5), st.data())
def test_auto_split_covers_every_layer_or_refuses_to_cut_a_group(case, pp_size, data):
    p = parse_pattern(case[0])
    first = data.draw(st.none() | st.integers(0, p.physical_layer_count), label="first")
    try:
        stages = pipeline_segments(p, pp_size, first_stage_layers=first if pp_size > 1 else None)
    except HybridPatternError as error:
        # A real cut: the named logical layer is a group that straddles a stage boundary.
        assert error.message.startswith("splitting") and error.position is not None
        assert p.pattern[error.position] == "["
        return
    except ValueError as error:
        assert "divide" in str(error) or "fit" in str(error) or "equally" in str(error)
        return
    assert len(stages) == pp_size
    assert tuple(item for s in stages for item in s.items) == p.items
    offset = 0
    for s in stages:
        assert s.physical_offset == offset and s.segment_index is None
        assert not s.items or p.logical_layers[s.logical_offset].layer_numbers[0] == offset + 1
        offset += s.physical_layer_count
    if first is not None and pp_size > 1:
        assert stages[0].physical_layer_count == first
    assert offset == p.physical_layer_count


@pytest.mark.parametrize("pattern", ["[*E]{7}", "M[*E]{3}-", "(M[*E]){3}"])
def test_auto_split_cut_is_real(pattern):
    """Every pp_size either splits at group boundaries or names a group that it would cut."""
    p = parse_pattern(pattern)
    starts = {layer.layer_numbers[0] - 1 for layer in p.logical_layers} | {p.physical_layer_count}
    for pp_size in range(1, p.physical_layer_count + 1):
        if p.physical_layer_count % pp_size:
            continue
        share = p.physical_layer_count // pp_size
        cuts = any(k * share not in starts for k in range(1, pp_size))
        if cuts:
            with pytest.raises(HybridPatternError):
                pipeline_segments(p, pp_size)
        else:
            assert len(pipeline_segments(p, pp_size)) == pp_size

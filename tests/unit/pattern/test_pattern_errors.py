"""Patterns the grammar rejects: message, position, caret rendering, no hang on huge input."""

from __future__ import annotations

import contextlib
import pickle
import signal

import pytest

from megatron_hybrid.pattern import MAX_NESTING_DEPTH, HybridPatternError, parse_pattern

NESTED = "(" * (MAX_NESTING_DEPTH + 1) + "M" + "){2}" * (MAX_NESTING_DEPTH + 1)

# (id, pattern, regex the message matches, position)
INVALID = [
    # no layer at all (whole-pattern errors)
    ("empty", "", "the pattern is empty", None),
    ("only-pipe", "|", "has no layer", None),
    ("only-slash", "/", "has no layer", None),
    ("only-separators", "||/", "has no layer", None),
    # unknown characters, whitespace included
    ("leading-space", " M", "whitespace ' '", 0),
    ("inner-space", "M *", "whitespace", 1),
    ("tab", "M\t*", r"whitespace '\\t'", 1),
    ("newline", "M*M*\n", "whitespace", 4),
    ("space-in-group", "[ *]", "whitespace", 1),
    ("lowercase", "m", "invalid character 'm'", 0),
    ("unknown-letter", "M*X", "invalid character 'X'", 2),
    ("x-repetition", "M*x2", "invalid character 'x'", 2),
    ("bare-digit", "M3", "invalid character '3'", 1),
    ("non-ascii", "[*E]\u00e9", r"invalid character '\\xe9'", 4),
    # brackets
    ("stray-close", "]", r"'\]' at position 0 closes a layer group that was not opened", 0),
    ("extra-close", "[*E]]", "closes a layer group that was not opened", 4),
    ("unclosed", "[*E", r"'\[' at position 0 opens a layer group that is never closed", 0),
    ("unclosed-later", "M[*E", "never closed", 1),
    ("empty-group", "[]", "empty layer group at position 0", 1),
    ("nested", "[[*]]", r"'\[' at position 1 is inside the layer group", 1),
    ("nested-later", "[*[E]]", "inside the layer group", 2),
    ("pipe-in-group", "[*|E]", r"'\|' at position 2 is inside the layer group", 2),
    ("slash-in-group", "[*/E]", "'/' at position 2 is inside the layer group", 2),
    ("repeat-in-group", "[*E{2}]", "'{' at position 3 is inside the layer group", 3),
    ("paren-in-group", "[*(E)]", r"'\(' at position 2 is inside the layer group", 2),
    ("close-paren-in-group", "(*[E)]{2}", r"'\)' at position 4 is inside the layer group", 4),
    # slot rule: at most one member per slot
    ("two-attention", "[**]", "second attention-slot layer", 2),
    ("attention-and-dsa", "[*D]", "second attention-slot layer", 2),
    ("attention-and-gdn", "[*G]", "second attention-slot layer", 2),
    ("two-mamba", "[MM]", "second mixer-slot layer", 2),
    ("mlp-and-moe", "[-E]", "second MLP-slot layer", 2),
    ("two-moe", "[EE]", "second MLP-slot layer", 2),
    ("second-mlp-after-three", "[M*E-]", "second MLP-slot layer", 4),
    # slot rule: the MLP-slot member is last
    ("mlp-first", "[-*]", r"'-' \(dense MLP\) at position 1 must be the last layer", 1),
    ("moe-first", "[E*]", r"'E' \(MoE\) at position 1 must be the last layer", 1),
    ("moe-before-mamba", "[EM]", "must be the last layer", 1),
    ("moe-in-middle", "M[*EM]", "must be the last layer", 3),
    # repetition counts
    ("zero", "[*E]{0}", "repetition count 0 at position 5 repeats nothing", 5),
    ("zeros", "[*E]{00}", "repeats nothing", 5),
    ("leading-zero", "[*E]{01}", "leading zero", 5),
    ("empty-count", "[*E]{}", "empty repetition count", 5),
    ("letter-count", "[*E]{x}", "invalid repetition count", 5),
    ("negative-count", "M{-1}", "invalid repetition count", 2),
    ("unclosed-count", "[*E]{3", "'{' at position 4 is never closed", 4),
    ("lone-brace", "[*E]{", "never closed", 4),
    ("junk-in-count", "[*E]{3x}", "'x' at position 6 ends the repetition count", 6),
    ("stray-close-brace", "M}", "closes a repetition count that was not opened", 1),
    # '{' with nothing to repeat
    ("repeat-at-start", "{3}M", "'{' at position 0 has nothing to repeat", 0),
    ("repeat-after-pipe", "M|{3}", "nothing to repeat", 2),
    ("repeat-after-paren", "({2}M){2}", "nothing to repeat", 1),
    ("double-repeat", "M{2}{3}", r"nothing to repeat: 'M' is already repeated by \{2\}", 4),
    ("double-repeat-group", "[*E]{2}{2}", "already repeated", 7),
    ("double-repeat-huge", "(*E){100000}{3}", "already repeated", 12),
    # parentheses
    ("stray-paren", ")", r"'\)' at position 0 closes a parenthesis that was not opened", 0),
    ("stray-paren-later", "M)", "closes a parenthesis", 1),
    ("unclosed-paren", "(*E", r"'\(' at position 0 is never closed", 0),
    ("unclosed-outer-paren", "((*E){2}", "never closed", 0),
    ("paren-not-repeated", "(*E)", r"the run '\(...\)' opened at position 0 is not repeated", 4),
    ("paren-not-repeated-mid", "(*E)M", "is not repeated", 4),
    ("empty-parens", "()", "empty parentheses at position 0", 1),
    ("empty-parens-repeated", "(){2}", "empty parentheses", 1),
    ("pipe-in-parens", "(*E|*E){2}", r"'\|' at position 3 is inside the parentheses", 3),
    ("slash-in-parens", "(*E/*E){2}", "'/' at position 3 is inside the parentheses", 3),
    ("too-deep", NESTED, "nests parentheses deeper than", MAX_NESTING_DEPTH),
    # MTP parts
    ("group-in-mtp", "/[*E]", "opens a layer group in an MTP part", 1),
    ("group-in-later-mtp", "M|*E/*E/[*E]", "in an MTP part", 8),
    ("pipe-in-mtp", "*E/*|E", r"'\|' at position 4 is in an MTP part", 4),
    ("mtp-differ", "*E/*E/*-", "all MTP depths must be identical.*depth 2 is '\\*-'", None),
    ("mtp-trailing-empty", "*E/*E/", "all MTP depths must be identical", None),
    ("mtp-differ-expanded", "M/M{2}/M", "depth 1 is 'MM' and depth 2 is 'M'", None),
    # one attention family per model
    (
        "attention-with-dsa",
        "*D",
        r"'\*' \(attention\) and 'D' .* cannot be used in one model",
        None,
    ),
    ("attention-with-mla-in-mtp", "*E/+E", "cannot be used in one model", None),
    ("attention-with-dsa-other-segment", "[*E]|[DE]", "cannot be used in one model", None),
    # the 100,000-layer limit, checked before expanding
    ("limit-group", "[*E]{50001}", "expands to 100,002 physical layers", None),
    ("limit-symbol", "*{100001}", "above the limit of 100,000", None),
    ("limit-huge-count", "[*E]{99999999999}", "expands to 199,999,999,998", None),
    ("limit-thousands-of-digits", "M{" + "9" * 5000 + "}", "more than 100,000", None),
    ("limit-main-plus-mtp", "[*E]{50000}/*E", "expands to 100,002", None),
    ("limit-mtp-depths", "*/(*){50000}/(*){50000}", "expands to 100,001", None),
    ("limit-nested", "((((*E){1000}){1000}){1000}){1000}", "to 2,000,000,000,000 ", None),
    ("limit-beyond-counting", "((*){99999999}){99999999}", "more than 100,000", None),
]


@pytest.mark.parametrize(
    ("pattern", "match", "position"),
    [case[1:] for case in INVALID],
    ids=[case[0] for case in INVALID],
)
def test_invalid_pattern(pattern, match, position):
    with pytest.raises(HybridPatternError, match=match) as info:
        parse_pattern(pattern)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.pattern == pattern
    assert error.position == position
    assert error.expected


@pytest.mark.parametrize(
    ("pattern", "position"),
    [(case[1], case[3]) for case in INVALID if case[3] is not None and case[1].isascii()],
    ids=[case[0] for case in INVALID if case[3] is not None and case[1].isascii()],
)
def test_caret_points_at_position(pattern, position):
    with pytest.raises(HybridPatternError) as info:
        parse_pattern(pattern)
    lines = str(info.value).splitlines()
    assert lines[1].startswith("  pattern: ")
    column = lines[2].index("^")
    assert set(lines[2][:column]) == {" "}
    shown = lines[1]
    if "..." not in shown:  # short patterns are shown whole, right after the quote
        assert column == len("  pattern: '") + position
    if position < len(pattern) and pattern[position].isprintable():
        assert shown[column] == pattern[position]
    assert any(line.startswith("  expected: ") for line in lines)


def test_message_layout():
    with pytest.raises(HybridPatternError) as info:
        parse_pattern("*E[*E")
    assert str(info.value).splitlines() == [
        "'[' at position 2 opens a layer group that is never closed",
        "  pattern: '*E[*E'",
        "              ^",
        "  expected: ']' after the group's layer symbols",
        "  fix: close the group, e.g. '[*E]'",
    ]


def test_whole_pattern_error_has_no_caret():
    with pytest.raises(HybridPatternError) as info:
        parse_pattern("*E/D")
    text = str(info.value)
    assert "^" not in text and "  pattern: '*E/D'" in text and "fix: " in text


def test_long_pattern_shows_a_window_around_the_error():
    pattern = "M" * 500 + "X" + "M" * 500
    with pytest.raises(HybridPatternError) as info:
        parse_pattern(pattern)
    lines = str(info.value).splitlines()
    assert lines[1].count("...") == 2 and len(lines[1]) < 100
    assert lines[1][lines[2].index("^")] == "X"


def test_escaped_character_keeps_caret_aligned():
    with pytest.raises(HybridPatternError) as info:
        parse_pattern("M\u00e9*")
    lines = str(info.value).splitlines()
    assert lines[1] == "  pattern: 'M\\xe9*'"
    assert lines[1][lines[2].index("^") :].startswith("\\xe9")


def test_error_at_end_points_past_last_character():
    with pytest.raises(HybridPatternError) as info:
        parse_pattern("(M*)")
    lines = str(info.value).splitlines()
    assert lines[1][lines[2].index("^")] == "'"  # the closing quote, where '{N}' belongs


def test_first_error_wins():
    # ']' at 0 comes before the unknown character at 2
    with pytest.raises(HybridPatternError, match="closes a layer group") as info:
        parse_pattern("]MX")
    assert info.value.position == 0


def test_error_pickles_with_attributes():
    with pytest.raises(HybridPatternError) as info:
        parse_pattern("[**]")
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.pattern, copy.position, copy.expected, str(copy)) == (
        "[**]",
        2,
        info.value.expected,
        str(info.value),
    )


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging: a guard against runaway parsing, not a performance check."""

    def expire(*_):
        raise TimeoutError(f"parsing took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "pattern",
    [
        "M{" + "9" * 100_000 + "}",
        "(" * 30 + "[*E]" + "){99999}" * 30,
        "[*E]{99999}" * 1000,
        "/".join(["(*E){9999}"] * 1000),
        "M" * 100_000 + "X",
        "[" * 100_000,
        "{" + "1" * 100_000,
    ],
    ids=["huge-digits", "nested-huge", "many-huge", "many-mtp", "long-literal", "brackets", "open"],
)
def test_huge_inputs_fail_without_hanging(pattern):
    with deadline(10), pytest.raises(HybridPatternError):
        parse_pattern(pattern)


def test_pattern_length_is_bounded():
    from megatron_hybrid.pattern import MAX_PATTERN_LENGTH

    pattern = "E" + "|" * MAX_PATTERN_LENGTH
    with pytest.raises(HybridPatternError, match=r"characters long, above the limit of") as info:
        parse_pattern(pattern)
    assert info.value.pattern == pattern and len(str(info.value)) < 500


def test_long_literals_are_not_cached():
    """Rejected long patterns must not stay alive in the literal cache (cache_clear cannot
    reach it); short literals, the common case, are cached."""
    from megatron_hybrid.pattern import tokenizer

    tokenizer._read_short_literal.cache_clear()
    with pytest.raises(HybridPatternError):
        parse_pattern("*E" * 20_000 + "X")
    with pytest.raises(HybridPatternError):
        parse_pattern("*" * 20_000 + "[E*]")
    assert tokenizer._read_short_literal.cache_info().currsize == 0  # both literals were long
    tokenizer.read_literal("M" * 1000)
    assert tokenizer._read_short_literal.cache_info().currsize == 0
    parse_pattern("[*E]{3}M-")
    assert tokenizer._read_short_literal.cache_info().currsize > 0  # short ones are cached


def test_error_window_in_a_huge_pattern():
    pattern = "M" * 100_000 + "X" + "M" * 99_000
    with pytest.raises(HybridPatternError) as info:
        parse_pattern(pattern)
    lines = str(info.value).splitlines()
    assert lines[1].count("...") == 2 and len(lines[1]) < 100
    assert lines[1][lines[2].index("^")] == "X"

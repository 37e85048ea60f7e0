"""Pipeline layout: cut a parsed pattern into pipeline (virtual) stages.

With ``|`` in the pattern each segment is one stage (virtual stage major, then rank); without it
the main pattern is split by physical layer counts, never inside a group.
:func:`select_pipeline_segment` returns one stage as a :class:`PipelineSelection`;
:func:`pipeline_segments` returns them all.

>>> from megatron_hybrid.pattern import parse_pattern
>>> p = parse_pattern("[*-]{2}|[*E]{2}/*E")
>>> sel = select_pipeline_segment(p, pp_rank=1, pp_size=2)
>>> items_to_str(sel.items), sel.physical_offset, sel.logical_offset
('[*E][*E]', 4, 2)
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from itertools import accumulate, pairwise

from megatron_hybrid.checks import check_int
from megatron_hybrid.pattern.errors import HybridPatternError
from megatron_hybrid.pattern.grammar import parse_pattern
from megatron_hybrid.pattern.layout import (
    Item,
    ParsedPattern,
    item_physical_count,
    item_to_str,
    items_to_str,
)
from megatron_hybrid.pattern.symbols import MTP_SEPARATOR, PIPE

__all__ = [
    "PipelineSelection",
    "pipeline_segments",
    "select_pipeline_segment",
    "virtual_stages",
    "with_option_names",
    "with_stages",
]


@dataclass(frozen=True, slots=True)
class PipelineSelection:
    """The layers one pipeline rank builds for one virtual stage.

    Attributes:
        items: The items of this stage.
        physical_offset: Physical layers before this stage (its ``pp_layer_offset``).
        logical_offset: Logical layers before this stage (its first global logical index).
        segment_index: Index of the ``|`` segment, or ``None`` for an automatic split.
        pp_rank: Pipeline rank.
        pp_size: Pipeline size.
        vp_stage: Virtual stage (0 when the pattern has one stage per rank).
    """

    items: tuple[Item, ...]
    physical_offset: int
    logical_offset: int
    segment_index: int | None
    pp_rank: int
    pp_size: int
    vp_stage: int

    @property
    def physical_layer_count(self) -> int:
        """Physical layers of this stage."""
        return sum(map(item_physical_count, self.items))

    @property
    def logical_layer_count(self) -> int:
        """Logical layers of this stage."""
        return len(self.items)


def _quoted(p: ParsedPattern, limit: int = 60) -> str:
    """The typed pattern for a message, shortened when long (messages stay one line)."""
    text = p.pattern if len(p.pattern) <= limit else p.pattern[: limit - 3] + "..."
    return repr(text)


def _as_parsed(pattern: ParsedPattern | str) -> ParsedPattern:
    if isinstance(pattern, ParsedPattern):
        return pattern
    return parse_pattern(pattern)


def select_pipeline_segment(
    pattern: ParsedPattern | str,
    pp_rank: int,
    pp_size: int,
    vp_stage: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> PipelineSelection:
    """Select the layers of pipeline rank ``pp_rank`` and virtual stage ``vp_stage``.

    With ``|`` in the pattern, segment ``vp_stage * pp_size + pp_rank`` is chosen and the number of
    segments must be a multiple of ``pp_size``. Without ``|`` and ``pp_size > 1`` the main pattern
    is split by physical layer counts: equally, or with ``first_stage_layers`` /
    ``last_stage_layers`` physical layers on the first / last stage and the rest equal. Such a
    split may not cut a group.

    Args:
        pattern: A pattern string or a :class:`ParsedPattern`.
        pp_rank: Pipeline rank, ``0 <= pp_rank < pp_size``.
        pp_size: Pipeline size.
        vp_stage: Virtual stage (``None`` means 0); must be below
            ``num_segments // pp_size``.
        first_stage_layers: Physical layers on the first stage (automatic split only).
        last_stage_layers: Physical layers on the last stage (automatic split only).

    Returns:
        The stage's items with their physical and logical offsets.

    Raises:
        HybridPatternError: The pattern is invalid, or an automatic split would cut a group.
        ValueError: The ranks, sizes or stage layer counts do not fit the pattern.

    >>> sel = select_pipeline_segment("[*-][*-]|[*E][*E]", pp_rank=0, pp_size=1, vp_stage=1)
    >>> sel.items, sel.physical_offset, sel.logical_offset
    ((('*', 'E'), ('*', 'E')), 4, 2)
    >>> select_pipeline_segment("M*M*M*", pp_rank=1, pp_size=3).items
    ('M', '*')
    """
    p = _as_parsed(pattern)
    pp_size = check_int("pp_size", pp_size, 1)
    pp_rank = check_int("pp_rank", pp_rank, 0)
    if pp_rank >= pp_size:
        raise ValueError(f"pp_rank ({pp_rank}) must be < pp_size ({pp_size})")
    vp = 0 if vp_stage is None else check_int("vp_stage", vp_stage, 0)
    for name, value in (
        ("first_stage_layers", first_stage_layers),
        ("last_stage_layers", last_stage_layers),
    ):
        if value is not None:
            check_int(name, value, 0)

    if p.num_segments > 1:
        return _select_by_pipes(p, pp_rank, pp_size, vp, first_stage_layers, last_stage_layers)
    return _select_by_split(p, pp_rank, pp_size, vp, first_stage_layers, last_stage_layers)


def virtual_stages(pattern: ParsedPattern | str, pp_size: int) -> int:
    """Virtual stages per pipeline rank that the pattern's ``|`` segments imply (1 without ``|``).

    The one place that checks "the number of segments is a multiple of the pipeline size";
    command-line tools rename ``pp_size`` in the message with :func:`with_option_names`.

    Raises:
        ValueError: the segment count is not a multiple of ``pp_size``.

    >>> virtual_stages("[*E]|[*E]|[*E]|[*E]", 2), virtual_stages("[*E]{4}", 2)
    (2, 1)
    """
    p = _as_parsed(pattern)
    pp_size = check_int("pp_size", pp_size, 1)
    if p.num_segments == 1:
        return 1
    if p.num_segments % pp_size:
        raise ValueError(
            f"{_quoted(p)} has {p.num_segments} '|'-separated segments, which is not a multiple "
            f"of pp_size {pp_size}; write a multiple of {pp_size} segments (segments / pp_size = "
            "virtual stages per rank)"
        )
    return p.num_segments // pp_size


def with_stages(pattern: ParsedPattern | str, stages: int) -> str:
    """The pattern cut into ``stages`` ``|``-segments of nearly equal logical layer counts.

    For a pattern that has no ``|`` (a Hugging Face model's) to run under virtual pipeline
    stages: the earlier segments take one logical layer more where the count does not divide.
    The layers, their order and the checkpoint keys stay the same (keys never depend on the
    pipeline split); MTP depths are kept.

    Raises:
        ValueError: the pattern already has ``|``, or fewer logical layers than ``stages``.

    >>> with_stages("[GE]{3}[*E]/*E", 2), with_stages("M*-", 2)
    ('[GE][GE]|[GE][*E]/*E', 'M*|-')
    """
    p = _as_parsed(pattern)
    stages = check_int("stages", stages, 1)
    if p.num_segments > 1:
        raise ValueError(f"{_quoted(p)} already has '|' stage boundaries; keep them")
    items = p.items
    if len(items) < stages:
        raise ValueError(
            f"{_quoted(p)} has {len(items)} logical layers, too few for {stages} pipeline stages "
            "(one layer at least each)"
        )
    size, extra = divmod(len(items), stages)
    cuts = list(accumulate(size + (i < extra) for i in range(stages)))
    parts = [items_to_str(items[a:b]) for a, b in pairwise([0, *cuts])]
    mtp = (MTP_SEPARATOR + "".join(p.mtp_items)) * p.mtp_num_depths
    return PIPE.join(parts) + mtp


def pipeline_segments(
    pattern: ParsedPattern | str,
    pp_size: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> tuple[PipelineSelection, ...]:
    """Return every stage of the pattern, in layer order (virtual stage major, then rank).

    With ``|`` there are ``num_segments // pp_size`` virtual stages per rank, else one.

    >>> [(s.pp_rank, s.vp_stage, items_to_str(s.items)) for s in pipeline_segments("M|*|-|E", 2)]
    [(0, 0, 'M'), (1, 0, '*'), (0, 1, '-'), (1, 1, 'E')]
    """
    p = _as_parsed(pattern)
    return tuple(
        select_pipeline_segment(p, rank, pp_size, vp, first_stage_layers, last_stage_layers)
        for vp in range(virtual_stages(p, pp_size))
        for rank in range(pp_size)
    )


def _select_by_pipes(
    p: ParsedPattern,
    pp_rank: int,
    pp_size: int,
    vp_stage: int,
    first_stage_layers: int | None,
    last_stage_layers: int | None,
) -> PipelineSelection:
    if first_stage_layers is not None or last_stage_layers is not None:
        raise ValueError(
            f"first_stage_layers/last_stage_layers cannot be used with {_quoted(p)}: its '|' "
            "separators already define the pipeline stages; drop these settings or the '|'"
        )
    chunks = virtual_stages(p, pp_size)
    if vp_stage >= chunks:
        raise ValueError(
            f"vp_stage ({vp_stage}) must be < {chunks}: {_quoted(p)} has {p.num_segments} "
            f"segments, that is {chunks} virtual stage(s) per rank with pp_size={pp_size}"
        )
    index = vp_stage * pp_size + pp_rank
    before = p.segments[:index]
    return PipelineSelection(
        items=p.segments[index],
        physical_offset=sum(item_physical_count(i) for seg in before for i in seg),
        logical_offset=sum(map(len, before)),
        segment_index=index,
        pp_rank=pp_rank,
        pp_size=pp_size,
        vp_stage=vp_stage,
    )


def _stage_sizes(p: ParsedPattern, pp_size: int, first: int | None, last: int | None) -> list[int]:
    """Physical layers per stage for a split without ``|``."""
    total = p.physical_layer_count
    if first is None and last is None:
        if total % pp_size:
            raise ValueError(
                f"pp_size ({pp_size}) must divide the {total} physical layers of {_quoted(p)} "
                "when the pattern has no '|'; add '|' between stages or set "
                "first_stage_layers/last_stage_layers"
            )
        return [total // pp_size] * pp_size
    if pp_size == 1:
        raise ValueError("first_stage_layers/last_stage_layers need pp_size > 1")
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle = total - (first or 0) - (last or 0)
    if middle < 0 or (middle_stages == 0 and middle != 0):
        raise ValueError(
            f"first_stage_layers ({first}) and last_stage_layers ({last}) do not fit the {total} "
            f"physical layers of {_quoted(p)} with pp_size={pp_size}"
        )
    if middle_stages and middle % middle_stages:
        raise ValueError(
            f"the {middle} physical layers left after first_stage_layers ({first}) and "
            f"last_stage_layers ({last}) must split equally over {middle_stages} middle "
            f"stage(s) of {_quoted(p)}"
        )
    sizes = [middle // middle_stages if middle_stages else 0] * middle_stages
    return ([first] if first is not None else []) + sizes + ([last] if last is not None else [])


def _select_by_split(
    p: ParsedPattern,
    pp_rank: int,
    pp_size: int,
    vp_stage: int,
    first_stage_layers: int | None,
    last_stage_layers: int | None,
) -> PipelineSelection:
    if vp_stage > 0:
        raise ValueError(
            f"vp_stage ({vp_stage}) needs '|' in the pattern: virtual pipeline stages are "
            f"defined by '|' separators, and {_quoted(p)} has none"
        )
    sizes = _stage_sizes(p, pp_size, first_stage_layers, last_stage_layers)
    bounds = list(accumulate(sizes, initial=0))
    # starts[i] = physical offset of logical layer i; the final entry closes the last layer.
    starts = [layer.layer_numbers[0] - 1 for layer in p.logical_layers]
    starts.append(p.physical_layer_count)
    logical_bounds = [_logical_index_at(p, starts, bound, sizes) for bound in bounds]
    lo, hi = logical_bounds[pp_rank], logical_bounds[pp_rank + 1]
    return PipelineSelection(
        items=tuple(layer.item for layer in p.logical_layers[lo:hi]),
        physical_offset=bounds[pp_rank],
        logical_offset=lo,
        segment_index=None,
        pp_rank=pp_rank,
        pp_size=pp_size,
        vp_stage=vp_stage,
    )


def _logical_index_at(p: ParsedPattern, starts: list[int], bound: int, sizes: list[int]) -> int:
    """Return the logical index starting at physical offset ``bound``; raise if it cuts a group."""
    index = bisect.bisect_left(starts, bound)
    if starts[index] == bound:
        return index
    layer = p.logical_layers[index - 1]
    raise HybridPatternError(
        f"splitting {p.physical_layer_count} physical layers into pipeline stages of "
        f"{_sizes_text(sizes)} layers cuts logical layer {layer.index} (the group "
        f"{item_to_str(layer.item)} written at position {layer.position}) between physical "
        f"layers {bound} and {bound + 1}",
        pattern=p.pattern,
        position=layer.position,
        expected="stage boundaries between logical layers",
        hint=_pipe_hint(p, len(sizes)),
    )


def _nearest(values: list[int], target: float) -> int:
    """Index of the value of sorted ``values`` nearest to ``target`` (the first on a tie)."""
    i = bisect.bisect_left(values, target)
    if i == len(values) or (i > 0 and target - values[i - 1] <= values[i] - target):
        return i - 1
    return i


def _sizes_text(sizes: list[int]) -> str:
    """``25/25/25`` for a few stages, ``4000 x 25`` when all of many are equal."""
    if len(sizes) <= 8:
        return "/".join(map(str, sizes))
    if len(set(sizes)) == 1:
        return f"{len(sizes)} x {sizes[0]}"
    return "/".join(map(str, sizes[:4])) + f"/.../{sizes[-1]} ({len(sizes)} stages)"


def _pipe_hint(p: ParsedPattern, pp_size: int) -> str:
    """Suggest where to put ``|`` so that every stage holds whole groups."""
    advice = f"put {pp_size - 1} '|' between logical layers to choose the stages yourself"
    layers = p.logical_layers
    # ends[i] = physical layers before logical layer i; cut near each equal-share boundary.
    if len(p.canonical) > 100:
        return advice
    ends = [0] + [layer.layer_numbers[-1] for layer in layers]
    share = p.physical_layer_count / pp_size
    cuts = [_nearest(ends, k * share) for k in range(1, pp_size)]  # ends is sorted: bisect
    pieces = [0, *cuts, len(layers)]
    if any(a >= b for a, b in pairwise(pieces)):
        return advice
    suggestion = PIPE.join(
        items_to_str(layer.item for layer in layers[a:b]) for a, b in pairwise(pieces)
    )
    return f"{advice}, e.g. {suggestion!r}"


def with_option_names(error: ValueError, names: dict[str, str]) -> ValueError:
    """``error`` with the Python argument names in its text replaced (e.g. by CLI flags).

    The layout functions name their Python arguments (``pp_size``, ``first_stage_layers``); a
    command-line tool re-raises their errors with its own option names.

    >>> str(with_option_names(ValueError("pp_size (4) must divide 6"), {"pp_size": "--pp"}))
    '--pp (4) must divide 6'
    """
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")

    def rename(text: str | None) -> str | None:
        return None if text is None else pattern.sub(lambda m: names[m.group(1)], text)

    if isinstance(error, HybridPatternError):
        return HybridPatternError(
            rename(error.message), error.pattern, error.position, rename(error.expected),
            rename(error.hint),
        )  # fmt: skip
    return type(error)(rename(str(error)))

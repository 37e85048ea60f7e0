"""``describe PATTERN``: what a hybrid layer pattern builds, stage by stage.

Prints the canonical pattern, the layer counts, the pipeline stages and one row per logical layer
(members, layer numbers, PP rank / VPP chunk, checkpoint key prefix), then the MTP layers.
``--png FILE`` also draws the stack of each stage (matplotlib, the ``viz`` extra).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from megatron_hybrid.checkpointing.keys import (
    decoder_layer_key,
    final_norm_prefix,
    mtp_layer_prefix,
)
from megatron_hybrid.cli.main import Command, CommandError
from megatron_hybrid.pattern import (
    Item,
    ParsedPattern,
    PipelineSelection,
    item_to_str,
    items_to_str,
    layer_facts,
    layer_symbols,
    parse_pattern,
    pipeline_segments,
    with_option_names,
)

__all__ = ["COMMAND", "configure", "describe", "run"]

_EPILOG = """\
examples:
  python -m megatron_hybrid describe '[*-]{3}[*E]{58}/*E'
  python -m megatron_hybrid describe '[*E]{4}|[*E]{4}|[*E]{4}|[*E]{4}' --pp 2
  python -m megatron_hybrid describe '(M-M*-){4}' --pp 2 --png stack.png

Quote the pattern for the shell. A pattern starting with '-' goes after '--':
  python -m megatron_hybrid describe -- '-*-*'
"""


def _count(minimum: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse  # type: ignore[return-value]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``describe``."""
    parser.epilog = _EPILOG
    parser.add_argument("pattern", metavar="PATTERN", help="hybrid layer pattern")
    parser.add_argument(
        "--pp", type=_count(1), default=1, metavar="N", help="pipeline-parallel size (default 1)"
    )
    parser.add_argument(
        "--vpp",
        type=_count(1),
        metavar="N",
        help="virtual stages per rank; patterns with '|' imply segments / pp, which N must equal",
    )
    parser.add_argument(
        "--first-stage-layers",
        type=_count(0),
        metavar="N",
        help="physical layers on the first stage (patterns without '|' only)",
    )
    parser.add_argument(
        "--last-stage-layers",
        type=_count(0),
        metavar="N",
        help="physical layers on the last stage (patterns without '|' only)",
    )
    parser.add_argument(
        "--png",
        metavar="FILE",
        help="also draw the stack per stage into FILE (needs matplotlib: the 'viz' extra)",
    )


def _stages(parsed: ParsedPattern, args: argparse.Namespace) -> tuple[PipelineSelection, ...]:
    """Check the flags against the pattern and return every stage in layer order."""
    if parsed.num_segments > 1:
        if parsed.num_segments % args.pp:
            raise CommandError(
                f"--pp {args.pp} must divide the {parsed.num_segments} '|'-delimited segments of "
                f"{parsed.pattern!r}"
            )
        implied = parsed.num_segments // args.pp
        if args.vpp is not None and args.vpp != implied:
            raise CommandError(
                f"--vpp {args.vpp} disagrees with the pattern: {parsed.num_segments} segments / "
                f"--pp {args.pp} = {implied} virtual stage(s) per rank; drop --vpp or fix it"
            )
    elif args.vpp is not None and args.vpp > 1:
        raise CommandError(
            f"--vpp {args.vpp} needs '|' in the pattern: write pp * vpp = {args.pp * args.vpp} "
            "segments separated by '|'"
        )
    try:
        return pipeline_segments(parsed, args.pp, args.first_stage_layers, args.last_stage_layers)
    except ValueError as error:
        raise with_option_names(error, _OPTION_NAMES) from None


# The layout functions' argument names, as describe's options.
_OPTION_NAMES = {
    "pp_size": "--pp",
    "first_stage_layers": "--first-stage-layers",
    "last_stage_layers": "--last-stage-layers",
}


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]


def _shorten(text: str, limit: int = 400) -> str:
    # The table below lists every layer; a 20,000-character line would only bury it.
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _numbers(numbers: Sequence[int]) -> str:
    return str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"


def _kinds(members: Sequence[str]) -> str:
    return " + ".join(layer_facts(m).name for m in members)


def describe(parsed: ParsedPattern, stages: Sequence[PipelineSelection]) -> str:
    """Return the text ``describe`` prints for ``parsed`` split into ``stages``."""
    pp_size = stages[0].pp_size
    chunks = len(stages) // pp_size
    counts = parsed.layer_counts
    symbols = ", ".join(
        f"{s} {layer_facts(s).name}: {counts[s]}" for s in layer_symbols() if counts.get(s)
    )
    mtp = (
        f"{parsed.mtp_num_depths} depth(s) of {parsed.mtp_pattern!r} "
        f"({len(parsed.mtp_items)} layer(s) each)"
        if parsed.mtp_num_depths
        else "none"
    )
    if parsed.num_segments > 1:
        split = "stages set by '|'"
    else:
        split = "split by physical layer counts" if len(stages) > 1 else "no pipeline split"
    first_key = decoder_layer_key(parsed, 0) if parsed.logical_layer_count else None
    if not parsed.has_groups:
        keys = "megatron-core hybrid"
    elif first_key is not None and first_key.layer_axis is not None:
        keys = "logical, GPTModel's stacked form ([i/L]: index i of a leading layer axis of size L)"
    else:
        keys = "logical (the main pattern has groups)"
    lines = [
        f"pattern    {parsed.pattern}",
        f"canonical  {_shorten(parsed.canonical)}",
        f"layers     {parsed.physical_layer_count} physical, {parsed.logical_layer_count} "
        f"logical in {parsed.num_segments} segment(s)",
        f"symbols    {symbols}",
        f"MTP        {mtp}",
        f"pipeline   pp {pp_size} x vpp {chunks} = {len(stages)} stage(s); {split}",
        f"keys       {keys}; final norm {final_norm_prefix(parsed)}",
        "",
    ]
    stage_rows = [
        (
            i,
            s.pp_rank,
            s.vp_stage,
            f"{s.physical_layer_count}/{s.logical_layer_count}",
            f"{s.physical_offset}/{s.logical_offset}",
            _shorten(items_to_str(s.items), 60) or "(empty)",
        )
        for i, s in enumerate(stages)
    ]
    headers = ("stage", "pp rank", "vpp chunk", "layers phys/log", "offset phys/log", "items")
    lines += _table(headers, stage_rows) + [""]

    layer_rows = []
    for s in stages:
        for layer in parsed.logical_layers[s.logical_offset : s.logical_offset + len(s.items)]:
            layer_rows.append(
                (
                    layer.index,
                    item_to_str(layer.item),
                    _kinds(layer.members),
                    _numbers(layer.layer_numbers),
                    s.pp_rank,
                    s.vp_stage,
                    str(decoder_layer_key(parsed, layer.index)),
                )
            )
    headers = ("logical", "members", "kind", "layer numbers", "pp rank", "vpp chunk", "key prefix")
    lines += _table(headers, layer_rows)

    if parsed.mtp_num_depths:
        last = stages[-1]
        mtp_rows = [
            (
                depth,
                j,
                symbol,
                layer_facts(symbol).name,
                last.pp_rank,
                last.vp_stage,
                mtp_layer_prefix(depth, j, parsed),
            )
            for depth in range(parsed.mtp_num_depths)
            for j, symbol in enumerate(parsed.mtp_items)
        ]
        headers = ("MTP depth", "layer", "symbol", "kind", "pp rank", "vpp chunk", "key prefix")
        lines += ["", *_table(headers, mtp_rows)]
    return "\n".join(lines)


def draw(parsed: ParsedPattern, stages: Sequence[PipelineSelection], path: Path) -> None:
    """Draw each stage as a column of layers (layer 1 at the bottom) into ``path``.

    Raises:
        CommandError: matplotlib is missing or ``path`` cannot be written.
    """
    try:
        # The Figure API renders with Agg and never touches pyplot's global backend state.
        from matplotlib.collections import PatchCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise CommandError(
            "--png needs matplotlib; install it with: pip install 'megatron_hybrid[viz]'"
        ) from None

    # One column per stage, then one for the MTP depths (drawn on top of each other).
    columns: list[tuple[Sequence[Item], str]] = [
        (stage.items, f"pp {stage.pp_rank}\nvpp {stage.vp_stage}") for stage in stages
    ]
    if parsed.mtp_num_depths:
        columns.append((parsed.mtp_items * parsed.mtp_num_depths, "MTP"))
    layers: list[Rectangle] = []
    outlines: list[Rectangle] = []
    colours: list[str] = []
    letters: list[tuple[float, float, str]] = []
    tallest = 1
    for x, (items, _) in enumerate(columns):
        y = 0
        for item in items:
            members = item if isinstance(item, tuple) else (item,)
            for symbol in members:
                layers.append(Rectangle((x + 0.1, y), 0.8, 0.9))
                colours.append(layer_facts(symbol).colour)
                letters.append((x + 0.5, y + 0.45, symbol))
                y += 1
            if isinstance(item, tuple):
                outlines.append(
                    Rectangle((x + 0.04, y - len(members) - 0.03), 0.92, len(members) - 0.04)
                )
        tallest = max(tallest, y)

    height = min(max(3.0, 0.28 * tallest + 1.6), 40.0)
    fig = Figure(figsize=(1.4 * len(columns) + 2.4, height))
    ax = fig.add_subplot()
    ax.add_collection(PatchCollection(layers, facecolors=colours, edgecolors="none"))
    ax.add_collection(PatchCollection(outlines, facecolors="none", edgecolors="black", lw=1.2))
    if tallest <= 120:  # symbol letters only while they stay legible
        for x, y, symbol in letters:
            ax.text(x, y, symbol, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(columns))
    ax.set_ylim(-0.2, tallest + 0.2)
    ax.set_xticks([i + 0.5 for i in range(len(columns))], [label for _, label in columns])
    ax.set_ylabel("layers in stage (bottom = first)")
    title = parsed.canonical if len(parsed.canonical) <= 60 else parsed.canonical[:57] + "..."
    ax.set_title(title, fontsize=9)
    counts = parsed.layer_counts
    handles = [
        Patch(color=layer_facts(s).colour, label=f"{s} {layer_facts(s).name}")
        for s in layer_symbols()
        if counts.get(s)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as error:
        raise CommandError(f"cannot write {str(path)!r}: {error.strerror or error}") from None


def _png_path(text: str) -> Path:
    """The file ``--png`` writes: ``.png`` appended unless given (matplotlib would add it)."""
    path = Path(text)
    if not text or text.endswith(("/", os.sep)) or path.is_dir():
        raise CommandError(f"--png needs a file name, got {text!r}")
    return path if path.suffix.lower() == ".png" else path.with_name(path.name + ".png")


def run(args: argparse.Namespace) -> int:
    """Run ``describe``; errors propagate to :func:`megatron_hybrid.cli.main.main`."""
    parsed = parse_pattern(args.pattern)
    stages = _stages(parsed, args)
    print(describe(parsed, stages))
    if args.png is not None:
        path = _png_path(args.png)
        draw(parsed, stages, path)
        print(f"\nwrote {path}")
    return 0


COMMAND = Command(
    name="describe",
    help="show the logical layers, pipeline stages and checkpoint keys of a pattern",
    configure=configure,
    run=run,
    description=__doc__,
)

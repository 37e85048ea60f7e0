"""``check-checkpoint``: would a torch_dist checkpoint (GPT or hybrid) load into a pattern?

Verifies the checkpoint's files against its integrity manifest (SHA-256 per file), reads the
checkpoint's metadata, builds the pattern's model on the meta device and prints missing,
unexpected and shape-mismatched tensors. The pattern and the model sizes not given are read from
the checkpoint (the pattern only from one 'train' saved). Exit code 0 if it would load, 1 if
not, 2 on bad input, a damaged checkpoint or a model that cannot be built.
"""

from __future__ import annotations

import argparse
from functools import partial

from megatron_hybrid.cli.main import Command, CommandError

__all__ = ["COMMAND"]

_SHOW = 20


def _configure(parser: argparse.ArgumentParser) -> None:
    from megatron_hybrid.training.arguments import MODEL_SHAPE_GROUPS, add_hybrid_args

    parser.add_argument(
        "--load",
        required=True,
        metavar="DIR",
        help="checkpoint: a save root (with latest_checkpointed_iteration.txt) or an iteration "
        "folder",
    )
    parser.usage = "%(prog)s --load DIR [--hybrid-layer-pattern PATTERN] [options]"
    add_hybrid_args(parser, groups=MODEL_SHAPE_GROUPS)
    # None = not given: read from the checkpoint (see checkpointing/settings.py).
    parser.set_defaults(hybrid_layer_pattern=None, **dict.fromkeys(_INFERRED))
    for option, text in _HELP.items():
        parser._option_string_actions[option].help = text


# Model-shape flags a checkpoint's tensors imply when they are not given.
_INFERRED = (
    "hidden_size", "vocab_size", "ffn_hidden_size", "swiglu", "disable_bias_linear",
    "untie_embeddings_and_output_weights",
)  # fmt: skip
_HELP = {
    "--hybrid-layer-pattern": "layer pattern (default: the one a 'train' checkpoint records)",
    "--max-position-embeddings": "maximum sequence length of learned absolute positions "
    "(default: 4096)",
}
for _option in ("--hidden-size", "--vocab-size", "--ffn-hidden-size"):
    _HELP[_option] = f"{_option[2:].replace('-', ' ')} (default: read from the checkpoint)"


def _fill_from_checkpoint(args: argparse.Namespace) -> list[str]:
    """Set the pattern and model-shape flags not given from the checkpoint; say which."""
    from megatron_hybrid.checkpointing.inspect import checkpoint_model_tensors
    from megatron_hybrid.checkpointing.settings import recorded_pattern, settings_from_checkpoint
    from megatron_hybrid.checkpointing.store import resolve_checkpoint_dir

    try:
        folder = resolve_checkpoint_dir(args.load)
    except FileNotFoundError as error:
        raise CommandError(str(error)) from None
    read = []
    if not args.hybrid_layer_pattern:
        args.hybrid_layer_pattern = recorded_pattern(folder)
        if not args.hybrid_layer_pattern:
            raise CommandError(
                f"{folder} records no layer pattern (it was not saved by 'train'): pass "
                "--hybrid-layer-pattern"
            )
        read.append(f"--hybrid-layer-pattern={args.hybrid_layer_pattern!r}")
    implied = settings_from_checkpoint(checkpoint_model_tensors(folder))
    for dest in _INFERRED:
        if getattr(args, dest) is None and dest in implied:
            setattr(args, dest, implied[dest])
            value = implied[dest]
            flag = "--" + dest.replace("_", "-")
            if value is not False:
                read.append(flag if value is True else f"{flag} {value}")
    for dest in _INFERRED:  # neither given nor implied: the usual default
        if getattr(args, dest) is None:
            delattr(args, dest)
    return read


def _listing(title: str, entries: list[str]) -> list[str]:
    lines = [f"{title} ({len(entries)}):"]
    lines += [f"  {entry}" for entry in entries[:_SHOW]]
    if len(entries) > _SHOW:
        lines.append(f"  ... and {len(entries) - _SHOW} more")
    return lines


def _run(args: argparse.Namespace) -> int:
    from megatron_hybrid.checkpointing.inspect import compare_with_checkpoint
    from megatron_hybrid.checkpointing.integrity import verify_checkpoint_files
    from megatron_hybrid.checkpointing.settings import mismatched_flags
    from megatron_hybrid.checkpointing.store import resolve_checkpoint_dir
    from megatron_hybrid.pattern import parse_pattern
    from megatron_hybrid.training.arguments import with_defaults
    from megatron_hybrid.training.config import hybrid_config_from_args
    from megatron_hybrid.training.validation import validate_settings

    try:
        # Files first: what is read from the checkpoint below must come from intact files.
        folder = resolve_checkpoint_dir(args.load)
        verified = verify_checkpoint_files(folder)  # a damaged file raises (exit 2)
    except FileNotFoundError as error:
        raise CommandError(str(error)) from None
    read = _fill_from_checkpoint(args)
    args = with_defaults(args)
    validate_settings(args, scopes=("model",))
    # Keys do not depend on the pipeline split, so '|' needs no pipeline flags here.
    unsplit = parse_pattern(args.hybrid_layer_pattern).unsplit
    config = hybrid_config_from_args(
        argparse.Namespace(**{**vars(args), "hybrid_layer_pattern": unsplit})
    )
    from megatron_hybrid.model import expected_keys
    from megatron_hybrid.runtime import select_backend

    select_backend().activate()  # the meta-device build calls megatron's CUDA-only functions
    build = partial(_expected, expected_keys.expected_checkpoint_tensors, config, args)
    try:
        result = compare_with_checkpoint(folder, build)
    except FileNotFoundError as error:
        raise CommandError(str(error)) from None
    except (CommandError, ValueError, ImportError):
        raise
    except Exception as error:  # noqa: BLE001 - exit 1 means "not loadable", never "crashed"
        raise CommandError(
            f"could not compare {args.load} with the model these flags describe "
            f"({type(error).__name__}: {error})"
        ) from None
    print(f"checkpoint: {result.checkpoint_dir}")
    print(f"files:      {'match integrity.json' if verified else 'not verified (no manifest)'}")
    print(f"pattern:    {args.hybrid_layer_pattern}")
    if read:
        print(f"read from the checkpoint: {' '.join(read)}")
    if result.metadata:
        print(f"metadata:   {result.metadata}")
    print(f"matching tensors: {result.matched}")
    if result.loads:
        print("OK: every tensor of the model is in the checkpoint with the same global shape")
        return 0
    lines = []
    if result.missing:
        lines += _listing("missing from the checkpoint", list(result.missing))
    if result.unexpected:
        lines += _listing("in the checkpoint but not in the model", list(result.unexpected))
    if result.shape_mismatches:
        lines += _listing(
            "global shape differs (model vs checkpoint)",
            [f"{key}: {exp} vs {found}" for key, exp, found in result.shape_mismatches],
        )
    print("\n".join(lines))
    flags = mismatched_flags(result.shape_mismatches, args)
    if flags and not (result.missing or result.unexpected):
        print(f"NOT LOADABLE: {'; '.join(flags)}")
    else:
        print("NOT LOADABLE: fix the pattern or the model-shape flags (see above)")
    return 1


def _expected(build, config, args, metadata):
    from megatron_hybrid.training.arguments import spec_backend

    return build(
        config,
        args.hybrid_layer_pattern,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or 4096,
        backend=spec_backend(args),
        metadata=metadata,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )


COMMAND = Command(
    name="check-checkpoint",
    help="say whether a torch_dist checkpoint (GPT or hybrid) loads into a pattern",
    configure=_configure,
    run=_run,
    description=__doc__,
)

"""``check-checkpoint``: would a torch_dist checkpoint (GPT or hybrid) load into a pattern?

Verifies the checkpoint's files against its integrity manifest (SHA-256 per file), reads the
checkpoint's metadata, builds the pattern's model on the meta device and prints missing,
unexpected and shape-mismatched tensors. Every model setting not given is read from the
checkpoint: a 'train' checkpoint records them all (a model started from Hugging Face: its
config), older ones their pattern, and tensor shapes imply the sizes. Settings given that differ
from the record are named. Exit code 0 if it would load, 1 if not, 2 on bad input, a damaged
checkpoint or a model that cannot be built.
"""

from __future__ import annotations

import argparse
from functools import partial

from megatron_hybrid.checkpointing.integrity import verify_checkpoint_files
from megatron_hybrid.checkpointing.settings import mismatched_flags, settings_from_checkpoint
from megatron_hybrid.cli.main import Command, CommandError
from megatron_hybrid.pattern import parse_pattern
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.training.arguments import (
    MODEL_SHAPE_GROUPS,
    add_hybrid_args,
    model_setting_dests,
    spec_backend,
    with_defaults,
)

__all__ = ["COMMAND"]

_SHOW = 20
_FROM_CHECKPOINT = "read from the checkpoint"
# Flags whose fallback here is not train's (no --seq-length to default to).
_HELP = {"max_position_embeddings": "maximum sequence length of learned absolute positions "
         "(default: 4096)"}  # fmt: skip


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--load",
        required=True,
        metavar="DIR",
        help="checkpoint: a save root (with latest_checkpointed_iteration.txt) or an iteration "
        "folder",
    )
    parser.usage = "%(prog)s --load DIR [model flags to compare] [options]"
    add_hybrid_args(parser, groups=MODEL_SHAPE_GROUPS)
    dests = set(model_setting_dests())
    for action in parser._actions:  # argparse keeps no public registry
        if action.dest not in dests:
            continue
        default, text = action.default, _HELP.get(action.dest, action.help or "")
        if "(default: " in text:
            text = text.replace("(default: ", f"(default: {_FROM_CHECKPOINT}, else ")
        elif default not in (None, False):
            text += f" (default: {_FROM_CHECKPOINT}, else {default})"
        else:
            text += f" (default: {_FROM_CHECKPOINT})"
        action.help = text.replace("%", "%%")
    # None = not given: taken from the checkpoint (see _settings).
    parser.set_defaults(**dict.fromkeys(dests))


def _flag_text(dest: str, value) -> str:
    flag = "--" + dest.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return f"no {flag}"
    if dest == "hybrid_layer_pattern":
        return f"{flag}={value!r}"
    return f"{flag} {value}"


def _settings(args: argparse.Namespace, folder):
    """The model settings to compare with: those given, else the checkpoint's.

    Returns:
        ``(args, read, differ, agreed)``: the completed flags, the settings read from the
        checkpoint (those that are not the flags' defaults), the given ones its record
        contradicts, and the ``dest`` of those that equal the checkpoint's.
    """
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing.inspect import checkpoint_model_tensors
    from megatron_hybrid.checkpointing.store import common_record, read_common

    dests = model_setting_dests()
    defaults = vars(with_defaults(argparse.Namespace()))
    given = {d: getattr(args, d) for d in dests if getattr(args, d) is not None}
    record = common_record(read_common(folder))
    recorded = record.get("model")
    if not isinstance(recorded, dict):  # older or foreign checkpoints: the tensors' word
        recorded = settings_from_checkpoint(checkpoint_model_tensors(folder))
        if record.get("hybrid_layer_pattern"):
            recorded["hybrid_layer_pattern"] = record["hybrid_layer_pattern"]
    if "hybrid_layer_pattern" not in given and not recorded.get("hybrid_layer_pattern"):
        raise CommandError(
            f"{folder} records no layer pattern (it was not saved by 'train'): pass "
            "--hybrid-layer-pattern"
        )
    values, read, differ = dict(given), [], []
    for dest in dests:
        if dest not in recorded:
            continue
        have = recorded[dest]
        if dest not in given:
            values[dest] = have
            if have != defaults.get(dest):
                read.append(_flag_text(dest, have))
        elif have is not None and given[dest] != have:
            differ.append(f"{_flag_text(dest, given[dest])} (the checkpoint's: "
                          f"{_flag_text(dest, have)})")  # fmt: skip
    agreed = {d for d in recorded if recorded[d] is not None and values.get(d) == recorded[d]}
    kept = {k: v for k, v in vars(args).items() if k not in dests}
    return with_defaults(argparse.Namespace(**kept, **values)), read, differ, agreed


def _listing(title: str, entries: list[str]) -> list[str]:
    lines = [f"{title} ({len(entries)}):"]
    lines += [f"  {entry}" for entry in entries[:_SHOW]]
    if len(entries) > _SHOW:
        lines.append(f"  ... and {len(entries) - _SHOW} more")
    return lines


def _run(args: argparse.Namespace) -> int:
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing.inspect import compare_with_checkpoint
    from megatron_hybrid.checkpointing.store import resolve_checkpoint_dir

    try:
        # Files first: what is read from the checkpoint below must come from intact files.
        folder = resolve_checkpoint_dir(args.load)
        verified = verify_checkpoint_files(folder)  # a damaged file raises (exit 2)
    except FileNotFoundError as error:
        raise CommandError(str(error)) from None
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.hf.dist import read_hf_record

    from_hf = read_hf_record(folder).get("hf_config") is not None
    if from_hf and args.hybrid_layer_pattern is None:
        build, args, read, differ, agreed = _hf_model(args, folder)
    else:
        build, args, read, differ, agreed = _flag_model(args, folder)
    select_backend().activate()  # the meta-device build calls megatron's CUDA-only functions
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
        print(f"{_FROM_CHECKPOINT}: {' '.join(read)}")
    if differ:
        print(f"given, unlike the checkpoint's record: {'; '.join(differ)}")
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
    flags = mismatched_flags(result.shape_mismatches, args, agreed)
    if flags and not (result.missing or result.unexpected):
        print(f"NOT LOADABLE: {'; '.join(flags)}")
    else:
        print("NOT LOADABLE: fix the pattern or the model-shape flags (see above)")
    return 1


def _flag_model(args: argparse.Namespace, folder):
    """The model of the flags, completed from the checkpoint: ``(build, args, read, differ,
    agreed)``."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.model import expected_keys
    from megatron_hybrid.training.config import hybrid_config_from_args
    from megatron_hybrid.training.validation import validate_settings

    args, read, differ, agreed = _settings(args, folder)
    validate_settings(args, scopes=("model",))
    # Keys do not depend on the pipeline split, so '|' needs no pipeline flags here.
    unsplit = parse_pattern(args.hybrid_layer_pattern).unsplit
    config = hybrid_config_from_args(
        argparse.Namespace(**{**vars(args), "hybrid_layer_pattern": unsplit})
    )
    build = partial(_expected, expected_keys.expected_checkpoint_tensors, config, args)
    return build, args, read, differ, agreed


def _hf_model(args: argparse.Namespace, folder):
    """The model of the Hugging Face config the checkpoint records (train --load-hf,
    convert --from-hf): ``(build, args, read, differ, agreed)``; model flags are refused."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing.store import common_record, read_common
    from megatron_hybrid.hf.api import expected_key_shapes
    from megatron_hybrid.hf.dist import conversion_of_checkpoint

    conversion = conversion_of_checkpoint(folder)
    ignored = [_flag_text(d, getattr(args, d)) for d in model_setting_dests()
               if getattr(args, d) is not None and d != "transformer_impl"]  # fmt: skip
    if ignored:
        raise CommandError(
            f"{folder} records the Hugging Face model it holds ({conversion.family}); its "
            f"config sets the model: drop {', '.join(ignored)} (or pass "
            "--hybrid-layer-pattern to compare with a model of flags instead)"
        )
    recorded = common_record(read_common(folder)).get("model") or {}
    impl = args.transformer_impl or recorded.get("transformer_impl") or "local"
    args = argparse.Namespace(**{**vars(args), "transformer_impl": impl,
                                 "hybrid_layer_pattern": conversion.pattern.pattern})  # fmt: skip
    build = partial(expected_key_shapes, conversion, spec_backend(args))
    read = [f"the Hugging Face config ({conversion.family})"]
    return (lambda metadata: build(metadata=metadata)), args, read, [], set()


def _expected(build, config, args, metadata):
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

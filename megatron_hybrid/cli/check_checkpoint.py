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
import dataclasses
from functools import partial

from megatron_hybrid.checkpointing.integrity import verify_checkpoint_files
from megatron_hybrid.checkpointing.settings import mismatched_flags
from megatron_hybrid.cli.main import Command, CommandError
from megatron_hybrid.pattern import parse_pattern
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.training.arguments import (
    MODEL_SHAPE_GROUPS,
    add_hybrid_args,
    model_setting_dests,
    spec_backend,
)
from megatron_hybrid.training.train_settings import TrainSettings, settings_from_args

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
    # None = not given: taken from the checkpoint (training/recorded.py).
    parser.set_defaults(**dict.fromkeys(dests))


def _listing(title: str, entries: list[str]) -> list[str]:
    lines = [f"{title} ({len(entries)}):"]
    lines += [f"  {entry}" for entry in entries[:_SHOW]]
    if len(entries) > _SHOW:
        lines.append(f"  ... and {len(entries) - _SHOW} more")
    return lines


def _run(namespace: argparse.Namespace) -> int:
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing.inspect import compare_with_checkpoint
    from megatron_hybrid.checkpointing.store import resolve_checkpoint_dir

    args = settings_from_args(namespace)  # the model flags not given stay None (see above)
    try:
        # Files first: what is read from the checkpoint below must come from intact files.
        folder = resolve_checkpoint_dir(args.load)
        verified = verify_checkpoint_files(folder)  # a damaged file raises (exit 2)
    except FileNotFoundError as error:
        raise CommandError(str(error)) from None
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing.store import read_record
    from megatron_hybrid.hf.dist import read_hf_record
    from megatron_hybrid.peft.checkpoint import LORA_RECORD

    lora = read_record(folder, LORA_RECORD)
    if lora is not None:
        return _lora_run(args, folder, lora, verified)
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
    # check-checkpoint has no --seq-length (its settings carry train's default): its learned
    # positions come from --max-position-embeddings, so --seq-length is never the suspect.
    flags = mismatched_flags(result.shape_mismatches, args, {*agreed, "seq_length"})
    if flags and not (result.missing or result.unexpected):
        print(f"NOT LOADABLE: {'; '.join(flags)}")
    else:
        print("NOT LOADABLE: fix the pattern or the model-shape flags (see above)")
    return 1


def _lora_run(args: TrainSettings, folder, record: dict, verified: bool) -> int:
    """A LoRA run's adapter checkpoint: its adapters, the base they need (found, and the one
    they were trained on?), and how to export them. Exit 0 if the base is there and matches."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.peft.checkpoint import BaseMismatchError, base_fingerprint, check_base
    from megatron_hybrid.peft.config import LoRAConfig

    given = [f"--{d.replace('_', '-')}" for d in model_setting_dests()
             if getattr(args, d) is not None]  # fmt: skip
    if given:
        raise CommandError(
            f"{folder} holds LoRA adapters, whose base sets the model: drop {', '.join(given)}"
        )
    config = LoRAConfig.from_dict(record["lora"])
    trained = record.get("base", {})
    base, kind = (trained.get("hf"), "Hugging Face folder")
    if base is None:
        base, kind = trained.get("checkpoint"), "torch_dist checkpoint"
    try:
        fingerprint = base_fingerprint(
            **({"hf_path": base} if kind.startswith("Hugging") else {"checkpoint": base})
        )
        check_base(record, fingerprint, where=str(folder), base=str(base))
        state = "present, the one the adapters were trained on"
    except BaseMismatchError as error:
        state = f"DIFFERS: {error}"
    except (OSError, ValueError) as error:
        state = f"MISSING ({type(error).__name__}: {error})"
    targets = "all-linear" if config.all_linear else ", ".join(config.targets)
    print(f"checkpoint: {folder}")
    print(f"files:      {'match integrity.json' if verified else 'not verified (no manifest)'}")
    print("LoRA run:   adapters only (their base's weights are not in it)")
    print(f"adapters:   rank {config.rank}, alpha {config.alpha:g} (scale {config.scale:g}"
          f"{', rsLoRA' if config.use_rslora else ''}), dropout {config.dropout:g}")  # fmt: skip
    print(f"targets:    {targets}" + (f" (exclude: {', '.join(config.exclude)})"
                                      if config.exclude else ""))  # fmt: skip
    print(f"base:       {base} ({kind}): {state}")
    print("export:     python -m megatron_hybrid convert --load "
          f"{args.load} --to-peft OUT_DIR   (a PEFT adapter folder)")  # fmt: skip
    print("            python -m megatron_hybrid convert --load "
          f"{args.load} --to-hf OUT_DIR --merge-lora   (the merged model)")  # fmt: skip
    if state.startswith("present"):
        print("OK: the adapters load on their recorded base")
        return 0
    print("NOT LOADABLE: the recorded base is missing or another one; give the base's "
          "Hugging Face folder to convert with --base-hf HF_DIR")  # fmt: skip
    return 1


def _flag_model(args: TrainSettings, folder):
    """The model of the flags, completed from the checkpoint: ``(build, args, read, differ,
    agreed)``."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.model import expected_keys
    from megatron_hybrid.training.config import hybrid_config_from_args
    from megatron_hybrid.training.recorded import recorded_settings_of
    from megatron_hybrid.training.validation import validate_settings

    settings = recorded_settings_of(args, folder)
    if not settings.recorded:
        raise CommandError(
            f"{folder} records no layer pattern (it was not saved by 'train'): pass "
            "--hybrid-layer-pattern"
        )
    args, read, differ, agreed = settings.args, settings.read, settings.differ, settings.agreed
    validate_settings(args, scopes=("model",))
    # Keys do not depend on the pipeline split, so '|' needs no pipeline flags here.
    unsplit = parse_pattern(args.hybrid_layer_pattern).unsplit
    config = hybrid_config_from_args(dataclasses.replace(args, hybrid_layer_pattern=unsplit))
    build = partial(_expected, expected_keys.expected_checkpoint_tensors, config, args)
    return build, args, read, differ, agreed


def _hf_model(args: TrainSettings, folder):
    """The model of the Hugging Face config the checkpoint records (train --load-hf,
    convert --from-hf): ``(build, args, read, differ, agreed)``; model flags are refused."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing.store import common_record, read_common
    from megatron_hybrid.hf.api import expected_key_shapes
    from megatron_hybrid.hf.dist import conversion_of_checkpoint
    from megatron_hybrid.training.recorded import flag_text

    conversion = conversion_of_checkpoint(folder)
    ignored = [flag_text(d, getattr(args, d)) for d in model_setting_dests()
               if getattr(args, d) is not None and d != "transformer_impl"]  # fmt: skip
    if ignored:
        raise CommandError(
            f"{folder} records the Hugging Face model it holds ({conversion.family}); its "
            f"config sets the model: drop {', '.join(ignored)} (or pass "
            "--hybrid-layer-pattern to compare with a model of flags instead)"
        )
    recorded = common_record(read_common(folder)).get("model") or {}
    impl = args.transformer_impl or recorded.get("transformer_impl") or "local"
    args = dataclasses.replace(
        args, transformer_impl=impl, hybrid_layer_pattern=conversion.pattern.pattern
    )
    build = partial(expected_key_shapes, conversion, spec_backend(args))
    read = [f"the Hugging Face config ({conversion.family})"]
    return (lambda metadata: build(metadata=metadata)), args, read, [], set()


def _expected(build, config, args: TrainSettings, metadata):
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

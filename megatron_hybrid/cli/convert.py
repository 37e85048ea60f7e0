"""``convert``: Hugging Face checkpoints to and from ``torch_dist``.

    python -m megatron_hybrid convert --from-hf HF_DIR --save CKPT
    python -m megatron_hybrid convert --load CKPT --to-hf OUT_DIR [--quantize fp8]
    python -m megatron_hybrid convert --from-hf HF_DIR --dry-run
    python -m megatron_hybrid convert --load RUN --to-peft OUT_DIR          # a LoRA run's adapter
    python -m megatron_hybrid convert --load RUN --to-hf OUT_DIR --merge-lora  # base + adapter

``--from-hf`` checks the conversion first (unsupported config fields, tensors without a source
or without a use, shapes) and copies nothing if it finds a problem. Block-scaled FP8 folders
(DeepSeek-V3, the Qwen FP8 releases) are dequantized on load and written as FP8 again by
``--to-hf`` (``--quantize source``, the default); the vision tower of a multimodal Qwen3.5 is
carried through untouched, and so are the tokenizer files, chat template and
``generation_config.json`` (a checkpoint keeps them in ``hf_files/``). Every output is checked
before any work and written beside its place, then moved in complete: one that is not empty is
refused unless ``--overwrite`` (which replaces it whole), a source of the command (the Hugging
Face folder a checkpoint was converted from, a LoRA run's base) is never written, and a failure
or Ctrl-C leaves the output as it was. Runs in one process (CPU or one GPU) or under
``torchrun`` with TP/PP/EP for models that do not fit one device. Exit codes: 0 done, 1 the dry
run found problems, 2 bad input or a failed write, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

from megatron_hybrid.checkpointing.outputs import check_output
from megatron_hybrid.cli.main import Command, CommandError, add_overwrite_flag
from megatron_hybrid.runtime import select_backend

__all__ = ["COMMAND"]

_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _configure(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("what to convert (one direction)")
    source.add_argument("--from-hf", metavar="HF_DIR", help="Hugging Face folder to read")
    source.add_argument("--save", metavar="CKPT", help="torch_dist checkpoint to write")
    source.add_argument("--load", metavar="CKPT", help="torch_dist checkpoint to read")
    source.add_argument("--to-hf", metavar="OUT_DIR", help="Hugging Face folder to write")
    source.add_argument(
        "--to-peft",
        metavar="OUT_DIR",
        help="with --load of a LoRA run: PEFT adapter folder to write (docs/lora.md)",
    )
    options = parser.add_argument_group("options")
    add_overwrite_flag(options, "--save/--to-hf/--to-peft")
    options.add_argument(
        "--merge-lora",
        action="store_true",
        help="with --load of a LoRA run and --to-hf: write the base with the adapter merged in",
    )
    options.add_argument(
        "--base-hf",
        metavar="HF_DIR",
        help="with --load of a LoRA run: the base's Hugging Face folder, where it no longer is "
        "where the run recorded it (its fingerprint must match)",
    )
    options.add_argument(
        "--peft-format",
        choices=["peft", "per_expert"],
        default=None,
        help="with --to-peft: routed experts in PEFT's 3-D layout, or per expert for engines "
        "that read experts.{e}.gate_proj (default: peft)",
    )
    options.add_argument(
        "--dry-run",
        action="store_true",
        help="with --from-hf: only list unsupported config fields and unmapped, unused or "
        "mismatched tensors (exit 1 if there are any)",
    )
    options.add_argument(
        "--hf-config",
        metavar="PATH",
        help="with --load: config.json (or its folder) describing the model, for checkpoints "
        "that do not store one",
    )
    options.add_argument(
        "--ignore-hf-config-field",
        action="append",
        default=[],
        metavar="NAME",
        help="accept this unmapped config field (repeatable); only for fields known not to "
        "change the math",
    )
    options.add_argument(
        "--no-mtp",
        action="store_true",
        help="leave out the MTP layers the config declares",
    )
    options.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="auto",
        help="parameter dtype (--from-hf) or output dtype (--to-hf); auto: the source's, with "
        "float32 router biases kept (default: %(default)s)",
    )
    options.add_argument(
        "--quantize",
        choices=["source", "fp8", "none"],
        default="source",
        help="with --to-hf: 'source' writes the format the model was converted from (FP8 "
        "weights and scales where it was FP8), 'fp8' the family's FP8 release recipe "
        "(128 x 128 blocks), 'none' no FP8 (default: %(default)s)",
    )
    options.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file with --to-hf (default: %(default)s)",
    )
    options.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="module implementation used while converting (default: %(default)s)",
    )
    for flag, name in (
        ("--tensor-model-parallel-size", "TP"),
        ("--pipeline-model-parallel-size", "PP"),
        ("--expert-model-parallel-size", "EP"),
    ):
        options.add_argument(
            flag, type=int, default=1, help=f"{name} size under torchrun (default: %(default)s)"
        )


def _check(args: argparse.Namespace) -> None:
    forward = args.from_hf is not None
    backward = args.load is not None or args.to_hf is not None or args.to_peft is not None
    if forward == backward:
        raise CommandError(
            "give one direction: --from-hf HF_DIR --save CKPT, or --load CKPT --to-hf OUT_DIR"
        )
    if forward and not args.save and not args.dry_run:
        raise CommandError("--from-hf needs --save CKPT (or --dry-run)")
    if args.to_hf and args.to_peft:
        raise CommandError("give one of --to-hf and --to-peft")
    if backward and not (args.load and (args.to_hf or args.to_peft)):
        raise CommandError(
            "--load goes with --to-hf OUT_DIR (or, for a LoRA run, --to-peft OUT_DIR)"
        )
    if args.merge_lora and not args.to_hf:
        raise CommandError("--merge-lora writes a Hugging Face folder: add --to-hf OUT_DIR")
    if args.peft_format and not args.to_peft:
        raise CommandError("--peft-format chooses what --to-peft writes: add --to-peft OUT_DIR")
    if args.base_hf and not (args.to_peft or args.merge_lora):
        raise CommandError("--base-hf goes with --to-peft or --merge-lora (a LoRA run's base)")
    if args.dry_run and not forward:
        raise CommandError("--dry-run checks a --from-hf conversion")
    if args.overwrite and args.dry_run:
        raise CommandError("--overwrite replaces an output; --dry-run writes none")
    if forward and args.quantize != "source":
        raise CommandError(
            "--quantize chooses what --to-hf writes; --from-hf dequantizes FP8 folders itself"
        )
    for flag in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
    ):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be >= 1")


def _dtype(args):
    import torch

    return None if args.dtype == "auto" else getattr(torch, args.dtype)


class _Progress:
    """A tqdm bar on stderr for ``(done, total)`` callbacks (rank 0 only), closed on every way
    out so that an error message starts on a line of its own."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled, self.bar = label, enabled, None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.label, unit="tensor", file=sys.stderr,
                            leave=False)  # fmt: skip
        self.bar.update(done - self.bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _check_conversion(args: argparse.Namespace):
    """``--from-hf`` opened, its config converted and its weights planned, once."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.hf.api import check_conversion

    return check_conversion(
        args.from_hf,
        backend="te" if args.transformer_impl == "transformer_engine" else "local",
        mtp=False if args.no_mtp else None,
        ignore_config_fields=args.ignore_hf_config_field,
    )


def _dry_run(args: argparse.Namespace) -> int:
    check = _check_conversion(args)
    conversion, report = check.conversion, check.report
    if conversion is not None:
        print(f"family {conversion.family} | pattern {conversion.pattern.pattern}")
        for note in conversion.notes:
            print(f"note: {note}")
    for line in report.lines():
        print(line)
    print("dry run: OK, every tensor maps" if report.ok else "dry run: problems found")
    return 0 if report.ok else 1


def _from_hf(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.hf import HFWeightsError, load_hf_model
    from megatron_hybrid.hf.dist import save_model_state

    sources = {"--from-hf": args.from_hf}
    check_output(args.save, overwrite=args.overwrite, sources=sources, flag="--save")
    check = _check_conversion(args)
    conversion = check.conversion
    if not check.report.ok:
        raise CommandError(
            f"{args.from_hf} does not convert cleanly; nothing was written:\n"
            + "\n".join(check.report.lines())
        )
    progress = _Progress("loading", _rank() == 0)
    try:
        model = load_hf_model(
            check.source,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            transformer_impl=args.transformer_impl,
            params_dtype=_dtype(args),
            progress=progress,
            conversion=conversion,
            plan=check.plan,
        )
    except HFWeightsError as error:
        raise CommandError(str(error)) from None
    finally:
        progress.close()
    folder = save_model_state(
        model, args.save, model.hf_conversion, overwrite=args.overwrite, sources=sources
    )
    if dist.get_rank() == 0:
        for line in check.report.notes:
            print(line)
        print(
            f"converted {args.from_hf} ({conversion.family}, {conversion.pattern.pattern}) "
            f"-> {folder}"
        )
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _to_hf(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch.distributed as dist

    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.hf.api import build_model
    from megatron_hybrid.hf.dist import (
        conversion_of_checkpoint,
        load_model_state,
        restore_hf_source,
    )
    from megatron_hybrid.hf.export import save_hf_checkpoint
    from megatron_hybrid.hf.io import CONFIG_FILE

    hf_config = None
    if args.hf_config:
        path = Path(args.hf_config)
        path = path / CONFIG_FILE if path.is_dir() else path
        try:
            hf_config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CommandError(f"--hf-config {args.hf_config}: {error}") from None
    try:
        conversion = conversion_of_checkpoint(
            args.load, hf_config, ignore_config_fields=args.ignore_hf_config_field
        )
    except FileNotFoundError as error:
        raise CommandError(str(error)) from None
    if args.no_mtp and conversion.mtp_layers:
        raise CommandError("--no-mtp: the checkpoint holds MTP layers; they are always exported")
    sources = {**_checkpoint_sources("--load", args.load), "--hf-config": args.hf_config}
    check_output(args.to_hf, overwrite=args.overwrite, sources=sources, flag="--to-hf")
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.process_groups import init_world, initialize_model_parallel

    select_backend().activate()
    _, world = init_world()
    tp_pp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world % tp_pp:
        raise CommandError(
            f"{world} processes cannot hold --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size = {tp_pp}; launch a multiple of {tp_pp} processes"
        )
    pg = initialize_model_parallel(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
    )
    model = build_model(conversion, pg, transformer_impl=args.transformer_impl)
    load_model_state(model, args.load)
    restore_hf_source(model, args.load)
    out = save_hf_checkpoint(
        model,
        args.to_hf,
        quantize=args.quantize,
        conversion=conversion,
        dtype=_dtype(args),
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        sources=sources,
    )
    if dist.get_rank() == 0:
        carried = len(getattr(model, "hf_carried", None) or {})
        kept = f"; {carried} tensors carried through untouched" if carried else ""
        print(f"wrote {out} ({conversion.family}, quantize={args.quantize}{kept})")
    return 0


def _checkpoint_sources(role: str, path) -> dict:
    """A checkpoint as a source, with the Hugging Face folder it records it came from (an
    output may replace neither)."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.hf.dist import read_hf_record

    try:
        recorded = read_hf_record(path).get("hf_path")
    except (OSError, ValueError):  # not a checkpoint (the command says so when it reads it)
        recorded = None
    return {role: path, f"the Hugging Face folder {path} was converted from": recorded}


def _is_lora_run(args: argparse.Namespace) -> bool:
    """Whether ``--load`` is a LoRA run's adapter checkpoint (refusing what does not fit)."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.training.lora import adapter_record

    adapters = adapter_record(args.load) is not None
    if args.to_hf and adapters and not args.merge_lora:
        raise CommandError(
            f"--load {args.load} holds LoRA adapters, not a model: add --merge-lora to write the "
            "base with the adapter merged in, or use --to-peft OUT_DIR for the adapter"
        )
    if not adapters and (args.to_peft or args.merge_lora or args.base_hf):
        flag = "--to-peft" if args.to_peft else "--merge-lora" if args.merge_lora else "--base-hf"
        raise CommandError(
            f"{flag} needs --load of a LoRA run (train --lora-rank ... --save RUN); "
            f"{args.load} holds no adapters"
        )
    return adapters


def _model_from_checkpoint(path, args, sizes):
    """The model of a converted (or Hugging Face started) ``torch_dist`` checkpoint."""
    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.hf.api import build_model
    from megatron_hybrid.hf.dist import (
        conversion_of_checkpoint,
        load_model_state,
        restore_hf_source,
    )
    from megatron_hybrid.process_groups import init_world, initialize_model_parallel

    select_backend().activate()
    init_world()
    pg = initialize_model_parallel(
        tp=sizes["tensor_model_parallel_size"],
        pp=sizes["pipeline_model_parallel_size"],
        ep=sizes["expert_model_parallel_size"],
    )
    model = build_model(conversion_of_checkpoint(path), pg, transformer_impl=args.transformer_impl)
    load_model_state(model, path)
    restore_hf_source(model, path)  # stored dtypes, FP8 scales, carried tensors
    return model


def _lora_export(args: argparse.Namespace) -> int:
    """``--load RUN --to-peft OUT`` / ``--to-hf OUT --merge-lora``: the base the run recorded
    (or ``--base-hf``), its adapters, written as a PEFT folder or merged."""
    import torch.distributed as dist

    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.checkpointing import store
    from megatron_hybrid.hf.api import load_hf_model
    from megatron_hybrid.hf.export import save_hf_checkpoint
    from megatron_hybrid.peft import apply_lora, save_peft_adapter
    from megatron_hybrid.peft.checkpoint import (
        LORA_RECORD,
        base_fingerprint,
        check_base,
        config_of_record,
        load_adapter_state,
        lora_sharded_state,
    )

    folder = store.resolve_checkpoint_dir(args.load)
    record = store.read_record(folder, LORA_RECORD)
    trained = record.get("base", {})
    sizes = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    base = args.base_hf or trained.get("hf") or trained.get("checkpoint")
    sources = {
        "--load": args.load,
        "the recorded base": trained.get("hf") or trained.get("checkpoint"),
        **_checkpoint_sources("the base", base),
    }
    out, flag = (args.to_peft, "--to-peft") if args.to_peft else (args.to_hf, "--to-hf")
    check_output(out, overwrite=args.overwrite, sources=sources, flag=flag)
    if args.base_hf or trained.get("hf"):
        check_base(record, base_fingerprint(hf_path=base), where=str(folder), base=base)
        model = load_hf_model(base, transformer_impl=args.transformer_impl, **sizes)
    else:  # a torch_dist base: read where the run recorded it
        check_base(record, base_fingerprint(checkpoint=base), where=str(folder), base=base)
        model = _model_from_checkpoint(base, args, sizes)
    apply_lora(model, config_of_record(record))
    load_adapter_state(model, store.read(folder, lora_sharded_state(model)))
    if args.to_peft:
        out = save_peft_adapter(
            model,
            args.to_peft,
            format=args.peft_format or "peft",
            dtype=_dtype(args),
            base_model_name_or_path=base,
            overwrite=args.overwrite,
            sources=sources,
        )
    else:
        out = save_hf_checkpoint(
            model,
            args.to_hf,
            quantize=args.quantize,
            dtype=_dtype(args),
            max_shard_size=args.max_shard_size,
            merge_lora=True,
            overwrite=args.overwrite,
            sources=sources,
        )
    if dist.get_rank() == 0:
        what = "adapter" if args.to_peft else "merged model"
        print(f"wrote {out} ({what} of {folder} on {base})")
    return 0


def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    _check(args)
    if args.dry_run:
        return _dry_run(args)
    started_world = not dist.is_initialized()
    try:
        if args.from_hf:
            return _from_hf(args)
        return _lora_export(args) if _is_lora_run(args) else _to_hf(args)
    finally:
        # On every way out, refusals included: a process group left to the interpreter's exit
        # can abort it instead of exiting with the command's code. A caller's world stays.
        if started_world and dist.is_initialized():
            dist.destroy_process_group()


COMMAND = Command(
    name="convert",
    help="convert Hugging Face checkpoints to and from torch_dist",
    configure=_configure,
    run=_run,
    description=__doc__,
)

"""The small pretraining loop behind ``python -m megatron_hybrid train``.

One process on CPU by default (megatron-core's CUDA-only calls emulated, gloo), or one process
per GPU under ``torchrun`` (NCCL) with any TP/PP/VPP/EP/CP/SP layout. Rank 0 names the device
and layout when training starts, shows a progress line per step (loss, gradient norm, tokens/s)
and a one-line summary at the end, whose throughput leaves out the warm-up step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from megatron_hybrid.checkpointing.inspect import compare_with_checkpoint, sharded_tensor_shapes
from megatron_hybrid.checkpointing.settings import mismatched_flags
from megatron_hybrid.hf.api import stack_spec_for
from megatron_hybrid.padding import padding_config_from, thd_unsupported_reason_for
from megatron_hybrid.pattern import GDN, parse_pattern
from megatron_hybrid.process_groups import init_world, initialize_model_parallel
from megatron_hybrid.runtime import RuntimeBackend, prefer_expandable_segments, select_backend
from megatron_hybrid.training import resume
from megatron_hybrid.training.arguments import model_setting_dests, spec_backend
from megatron_hybrid.training.checkpoint import consumed_samples, load_checkpoint, save_checkpoint
from megatron_hybrid.training.config import hybrid_config_from_args
from megatron_hybrid.training.data import MicroBatchBuilder, SyntheticTokens
from megatron_hybrid.training.fusions import apply_gpu_fusions
from megatron_hybrid.training.guard import check_step, describe
from megatron_hybrid.training.hf_source import hf_source, hf_training_config, load_initial_weights
from megatron_hybrid.training.hf_source import model_kwargs as hf_model_kwargs
from megatron_hybrid.training.loop import build_model_chunks, build_optimizer, train_step
from megatron_hybrid.training.lora import check_resumable, lora_run, parameter_counts
from megatron_hybrid.training.lora_rules import validate_lora_flags
from megatron_hybrid.training.save_target import (
    SaveTarget,
    check_save_sources,
    decide_save_target,
)
from megatron_hybrid.training.throughput import (
    PEAK_ENV,
    DevicePeak,
    StepFlops,
    device_peak,
    tflops_per_gpu,
    throughput_text,
)
from megatron_hybrid.training.validation import validate_settings

__all__ = [
    "TrainingError",
    "TrainingSummary",
    "batch_builder",
    "build_chunks",
    "check_resume_compatible",
    "model_config",
    "parallel_setup",
    "recorded_settings",
    "run_training",
]


class TrainingError(ValueError):
    """A setting or input that prevents training; printed as one message (exit code 2)."""


#: Steps at the start of a run that pay for one-time work (kernel autotuning and compilation,
#: lazy allocations, the first collectives) and are timed apart from the rest.
WARMUP_STEPS = 1


@dataclass(frozen=True)
class TrainingSummary:
    """What a run did, returned by :func:`run_training`.

    Attributes:
        first_iteration, last_iteration: the iterations the run went from and to.
        losses, grad_norms: per applied step (skipped non-finite steps left out).
        saved: the last checkpoint folder written, if any.
        step_seconds, step_tokens: wall time and real tokens of each applied step.
        step_flops: model FLOPs of each applied step (real tokens; ``training.throughput``).
        gpus: GPUs the run used (0 on the CPU: no TFLOP/s or MFU reported).
        peak: the peak MFU divides by (None: unknown, no MFU).
    """

    first_iteration: int
    last_iteration: int
    losses: list[float]
    grad_norms: list[float]
    saved: str | None
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_flops: list[float] = field(default_factory=list)
    gpus: int = 0
    peak: DevicePeak | None = None

    @property
    def warmup_seconds(self) -> float:
        """Wall time of the first :data:`WARMUP_STEPS` applied steps."""
        return sum(self.step_seconds[:WARMUP_STEPS])

    @property
    def median_step_seconds(self) -> float | None:
        """Median time of the steps after warm-up (None: the run had none)."""
        timed = self.step_seconds[WARMUP_STEPS:]
        return statistics.median(timed) if timed else None

    @property
    def tokens_per_second(self) -> float:
        """Median tokens/s of the steps after warm-up (the warm-up's own rate if none came
        after it; 0 without steps)."""
        pairs = list(zip(self.step_tokens, self.step_seconds, strict=True))
        timed = pairs[WARMUP_STEPS:] or pairs
        return statistics.median(t / s for t, s in timed) if timed else 0.0

    @property
    def throughput(self) -> str | None:
        """Median TFLOP/s per GPU and MFU of the steps after warm-up (the warm-up's if none came
        after it), as ``train`` prints them; None on the CPU or without FLOPs."""
        if not self.gpus or len(self.step_flops) != len(self.step_seconds):
            return None
        flops, seconds = self.step_flops[WARMUP_STEPS:], self.step_seconds[WARMUP_STEPS:]
        if not seconds:
            flops, seconds = self.step_flops, self.step_seconds
        return throughput_text(tflops_per_gpu(flops, seconds, self.gpus), self.peak)


def check_resume_compatible(chunks, folder, args=None) -> None:
    """Fail before training if the checkpoint does not fit the model (check-checkpoint's rules)."""
    from megatron.core.utils import unwrap_model

    local = {}
    for chunk in unwrap_model(list(chunks)):  # checkpoint keys of the model, not its DDP wrapper
        local.update(sharded_tensor_shapes(chunk.sharded_state_dict()))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    expected = {k: v for part in gathered for k, v in part.items()}
    result = compare_with_checkpoint(folder, lambda metadata: expected)
    if not result.loads:
        flags = mismatched_flags(result.shape_mismatches, args)
        if flags and not (result.missing or result.unexpected):
            raise TrainingError(f"--load {folder} does not fit the model: {'; '.join(flags)}")
        lines = [f"--load {folder} does not fit --hybrid-layer-pattern:"]
        for title, keys in (("missing", result.missing), ("unexpected", result.unexpected)):
            if keys:
                lines.append(f"  {title} ({len(keys)}): {', '.join(keys[:8])}")
        for key, want, have in result.shape_mismatches[:8]:
            lines.append(f"  shape of {key}: model {want}, checkpoint {have}")
        lines.append("run `python -m megatron_hybrid check-checkpoint` for the full list")
        raise TrainingError("\n".join(lines))


class _Progress:
    """Rank 0's per-step line: an updating bar on a terminal, plain lines in logs."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stdout.isatty()

    def update(
        self, iteration: int, loss: float, norm: float, tok_s: float, extra: str | None = None
    ) -> None:
        if not self.enabled:
            return
        done = int(20 * iteration / max(self.total, 1))
        bar = "#" * done + "." * (20 - done)
        line = (
            f"[{bar}] step {iteration:>5}/{self.total} | loss {loss:.4f} | "
            f"grad norm {norm:.3f} | {tok_s:,.0f} tok/s"
        ) + (f" | {extra}" if extra else "")
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", flush=True)

    def note(self, text: str) -> None:
        """A line of its own between progress updates."""
        if self.enabled:
            print(f"\n{text}" if self.tty else text, flush=True)

    def close(self) -> None:
        if self.tty:
            print()


@dataclass(frozen=True)
class _Setup:
    """What the training loop needs, built by :func:`run_training` before the first step.

    ``args`` are the effective settings: the flags, with a Hugging Face source's architecture in
    place of the model flags; ``load`` what to resume (None for a weights-only start).
    """

    args: argparse.Namespace
    load: str | None
    backend: RuntimeBackend
    config: object
    pg: object
    rank: int
    global_batch: int
    num_microbatches: int
    seq_length: int
    builder: object
    autotunes: bool
    lora: object = None
    peak: DevicePeak | None = None


def run_training(
    args: argparse.Namespace, backend: RuntimeBackend | None = None
) -> TrainingSummary:
    """Train the model ``args`` describe; see ``python -m megatron_hybrid train --help``.

    Args:
        args: the parsed ``train`` flags.
        backend: where to run (the CLI passes its choice); by default CUDA when a GPU is
            visible, else the CPU emulation.
    """
    prefer_expandable_segments()  # before CUDA starts: variable-length batches fragment memory
    validate_lora_flags(args)  # first: they decide where the model comes from
    lora = lora_run(args)  # adapters on a frozen base: where it comes from, what resumes
    # --load-hf (or a LoRA base): the architecture comes from the Hugging Face config
    source = lora.source() if lora is not None else hf_source(args)
    if source is not None:
        args = source.applied_to(args)  # the conversion's settings, validated and read below
    validate_settings(args)  # every setting, before any process group or model exists
    check_save_sources(args, lora, source)  # a file, unwritable, or one of the run's sources
    parsed = parse_pattern(args.hybrid_layer_pattern)
    backend = backend or select_backend()
    # fla's GatedDeltaNet kernels autotune in the first step (51 s on one H100 with Triton 3.6):
    # keep the results on disk so later runs skip it. Read when fla is imported, so set it now.
    autotunes = backend.on_gpu and bool(parsed.layer_counts.get(GDN, 0))
    if autotunes:
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    config = model_config(args, source, backend)  # validate flags before any process group
    try:
        peak = device_peak(backend.device_name() if backend.on_gpu else None)
    except ValueError as error:
        raise TrainingError(str(error)) from None
    backend.activate()
    rank, world = init_world()
    pg, global_batch, num_microbatches = parallel_setup(args, config, world)
    seq_length, builder = batch_builder(args, config, pg, parsed, rank, backend)
    chunks = build_chunks(args, config, pg, parsed, source, seq_length, rank, lora=lora)
    optimizer = build_optimizer(
        chunks, config, lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad, pg=pg
    )
    setup = _Setup(
        args=args,
        load=args.load if lora is not None or not (source and source.checkpoint) else None,
        backend=backend,
        config=config,
        pg=pg,
        rank=rank,
        global_batch=global_batch,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        builder=builder,
        autotunes=autotunes,
        lora=lora,
        peak=peak,
    )
    start, consumed, resumed = _resume(setup, chunks, optimizer)
    settings = recorded_settings(args, seq_length)
    target = decide_save_target(args, start, resumed, settings, lora=lora is not None)
    counts = parameter_counts(chunks, pg)  # collective: before rank 0 alone prints
    if rank == 0:
        print(_start_line(setup, world, start, counts), flush=True)
    return _train(setup, chunks, optimizer, start, consumed, target)


def _start_line(setup: _Setup, world: int, start: int, counts: tuple[int, int]) -> str:
    """``training PATTERN on DEVICE | layout | iterations``: what runs where, said once."""
    import torch

    args = setup.args
    comm = torch.distributed.get_backend()
    if setup.backend.on_gpu:
        where = f"{world} x {setup.backend.device_name()} ({comm})"
    else:
        where = f"CPU ({world} process{'es' if world > 1 else ''}, {comm})"
    layout = " ".join(f"{k.upper()}{v}" for k, v in resume.layout_of(setup.pg).items())
    trainable, total = counts
    share = f" ({100 * trainable / total:.2f}%)" if trainable != total else ""
    line = (
        f"training {args.hybrid_layer_pattern} on {where} | {layout} | iterations "
        f"{start}->{args.train_iters} | parameters {trainable:,} trainable of {total:,}{share}"
    )
    if setup.backend.on_gpu:  # what MFU divides by, said once
        peak = setup.peak
        line += (
            f" | MFU of {peak.tflops:g} TFLOP/s per GPU ({peak.source})"
            if peak is not None
            else f" | no MFU: no peak known for this GPU (set {PEAK_ENV} in TFLOP/s)"
        )
    return line


def model_config(args: argparse.Namespace, source, backend: RuntimeBackend):
    """The TransformerConfig, built once: from the flags, or from the Hugging Face source's
    conversion and the training flags."""
    overrides = backend.config_overrides()
    if source is not None:
        config = hf_training_config(source, args, **overrides)
    else:
        config = hybrid_config_from_args(args, **overrides)
    if backend.on_gpu:  # megatron's fused SwiGLU and cross-entropy, where they are exact
        apply_gpu_fusions(config)
    return config


def parallel_setup(args: argparse.Namespace, config, world: int):
    """Process groups, the global batch and the number of micro-batches per step."""
    model_parallel = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if world % model_parallel:
        raise TrainingError(
            f"{world} processes cannot hold TP x PP x CP = {model_parallel}; launch a multiple "
            f"of {model_parallel} processes"
        )
    pg = initialize_model_parallel(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        vpp=config.virtual_pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        cp=args.context_parallel_size,
        etp=args.expert_tensor_parallel_size,
        seed=args.seed,
    )
    dp = pg.dp.size()
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    if global_batch % (args.micro_batch_size * dp):
        raise TrainingError(
            f"--global-batch-size {global_batch} is not a multiple of micro-batch size x "
            f"data-parallel size = {args.micro_batch_size * dp}"
        )
    return pg, global_batch, global_batch // (args.micro_batch_size * dp)


def batch_builder(args, config, pg, parsed, rank: int, backend: RuntimeBackend):
    """The (aligned) sequence length and the builder of padded or packed micro-batches."""
    padding = padding_config_from(config, pg)
    seq_length = args.seq_length
    if padding.fixed_length_required:
        seq_length = padding.align_seq_length(
            seq_length,
            micro_batch_size=args.micro_batch_size,
            force_policy="round_up" if args.round_up_seq_length else "raise",
        )
    packed = args.packed
    if packed:
        symbols = {symbol for symbol, count in parsed.layer_counts.items() if count}
        reason = thd_unsupported_reason_for(symbols, config)
        if reason:
            packed = False
            if rank == 0:
                print(f"--packed: using padded (BSHD) batches instead: {reason}", flush=True)
    data = SyntheticTokens(vocab_size=args.vocab_size, max_length=seq_length, seed=args.seed)
    builder = MicroBatchBuilder(
        data,
        padding,
        micro_batch_size=args.micro_batch_size,
        seq_length=seq_length,
        packed=packed,
        equalize_group=pg.tp_ep,
        device=backend.device(),
    )
    return seq_length, builder


def build_chunks(
    args, config, pg, parsed, source, seq_length: int, rank: int, *, lora=None
) -> list:
    """The model chunks of this rank, initialised from the Hugging Face source if any, with
    the LoRA adapters of ``lora`` (a :class:`~megatron_hybrid.training.lora.LoRARun`)."""
    stack_spec = None
    if source is not None:
        stack_spec = stack_spec_for(source.conversion, spec_backend(args), config, args.mamba_impl)
    chunks = build_model_chunks(
        config,
        parsed,
        pg,
        backend=spec_backend(args),
        stack_spec=stack_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or seq_length,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        mamba_impl=args.mamba_impl,
        hybrid_cuda_graphs=args.hybrid_cuda_graphs,
        prepare=None if lora is None else lora.attach,
        **({} if source is None else hf_model_kwargs(source)),
    )
    if lora is not None:
        lora.load_base(chunks)
    if source is not None:
        # Before the optimizer: megatron's distributed optimizer copies the weights it starts
        # from.
        load_initial_weights(source, chunks)
        if rank == 0 and not source.resumed:
            where = source.hf_path or source.checkpoint
            print(f"initialised from {where} ({source.conversion.family})", flush=True)
    return chunks


def _resume(setup: _Setup, chunks, optimizer) -> tuple[int, int, object]:
    """Load ``--load`` (or the newest save) if there is one: ``(start iteration, consumed,
    the folder resumed from or None)``."""
    args = setup.args
    try:
        point = resume.prepare_resume(setup.load, args.save)
    except FileNotFoundError as error:
        raise TrainingError(str(error)) from None
    for note in point.notes if setup.rank == 0 else ():
        print(note, flush=True)
    if point.folder is None:
        return 0, 0, None
    folder = point.folder
    if setup.lora is not None:
        check_resumable(setup.lora, chunks, folder)
    else:
        check_resume_compatible(chunks, folder, args)
    start = load_checkpoint(folder, chunks, optimizer, layout=resume.layout_of(setup.pg))
    resume.check_target(start, args.train_iters, folder)
    consumed = consumed_samples(folder)
    consumed = start * setup.global_batch if consumed is None else consumed
    if setup.rank == 0:
        print(f"resumed from {folder} at iteration {start}", flush=True)
    return start, consumed, folder


def recorded_settings(args: argparse.Namespace, seq_length: int) -> dict:
    """The model settings a checkpoint records (``model_setting_dests``), as this run used
    them: ``--max-position-embeddings`` defaults to the sequence length here."""
    settings = {dest: getattr(args, dest, None) for dest in model_setting_dests()}
    settings["max_position_embeddings"] = args.max_position_embeddings or seq_length
    return settings


def _train(
    setup: _Setup, chunks, optimizer, start: int, consumed: int, target: SaveTarget
) -> TrainingSummary:
    """The steps from ``start`` to ``--train-iters``, with periodic and final saves (the first
    one replacing what ``--save`` held where ``target`` says so)."""
    args, rank, mbs = setup.args, setup.rank, setup.args.micro_batch_size
    dp_rank = setup.pg.dp.rank()
    progress = _Progress(args.train_iters, enabled=rank == 0)
    losses, norms, saved = [], [], None
    seconds, tokens, flops = [], [], []
    counter = StepFlops(setup.config, parse_pattern(args.hybrid_layer_pattern), args.vocab_size)
    gpus = torch.distributed.get_world_size() if setup.backend.on_gpu else 0
    for iteration in range(start, args.train_iters):
        base = consumed + dp_rank * setup.num_microbatches * mbs
        batches = counter.annotate(
            [
                setup.builder.build([base + m * mbs + b for b in range(mbs)])
                for m in range(setup.num_microbatches)
            ]
        )
        began = time.perf_counter()
        result = train_step(
            chunks,
            optimizer,
            batches,
            setup.config,
            # A packed micro-batch is one [1, seq_length * mbs] row (the pipeline's P2P shape).
            seq_length=setup.seq_length * (mbs if setup.builder.packed else 1),
            micro_batch_size=1 if setup.builder.packed else mbs,
            pg_collection=setup.pg,
        )
        setup.backend.synchronize()
        elapsed = time.perf_counter() - began
        consumed += setup.global_batch
        if check_step(result, iteration + 1, getattr(args, "on_nonfinite", "stop"), saved):
            if rank == 0:
                print(f"step {iteration + 1}: {describe(result)}: skipped", flush=True)
        else:
            seconds.append(elapsed)
            tokens.append(result.tokens)
            flops.append(result.flops)
            losses.append(result.loss)
            norms.append(result.grad_norm)
            rate = tflops_per_gpu([result.flops], [elapsed], gpus) if gpus else None
            progress.update(
                iteration + 1,
                result.loss,
                result.grad_norm,
                result.tokens / elapsed,
                throughput_text(rate, setup.peak),
            )
        if setup.autotunes and iteration == start:
            progress.note(
                f"first step took {elapsed:.0f} s with fla's kernel autotuning "
                "(cached by Triton for the next runs: TRITON_CACHE_AUTOTUNING=1)"
            )
        done = iteration + 1
        if args.save and (
            done == args.train_iters or (args.save_interval and done % args.save_interval == 0)
        ):
            saved = str(
                save_checkpoint(
                    args.save,
                    done,
                    chunks,
                    optimizer,
                    pattern=args.hybrid_layer_pattern,
                    model_settings=recorded_settings(args, setup.seq_length),
                    overwrite=args.overwrite,
                    consumed_samples=consumed,
                    layout=resume.layout_of(setup.pg),
                    run=target.run,
                    replace_root=target.replace_root and saved is None,
                )
            )
            if done != args.train_iters:  # the final save is in the summary line
                progress.note(f"saved {saved}")
    progress.close()
    return TrainingSummary(
        first_iteration=start,
        last_iteration=args.train_iters,
        losses=losses,
        grad_norms=norms,
        saved=saved,
        step_seconds=seconds,
        step_tokens=tokens,
        step_flops=flops,
        gpus=gpus,
        peak=setup.peak,
    )

"""The training loop behind ``python -m megatron_hybrid train``.

One process on CPU by default (megatron-core's CUDA-only calls emulated, gloo), or one process
per GPU under ``torchrun`` (NCCL) with any TP/PP/VPP/EP/CP/SP layout. Rank 0 names the device,
layout and data when training starts, shows a progress line every ``--log-interval`` steps
(loss, learning rate, gradient norm, tokens/s), the validation loss every ``--eval-interval``
steps and at the end, and a one-line summary, whose throughput leaves out the warm-up step.
The data (:mod:`~megatron_hybrid.training.inputs`), the learning-rate schedule
(:mod:`~megatron_hybrid.training.schedule`) and the metrics files
(:mod:`~megatron_hybrid.training.metrics`) live in modules of their own.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from megatron_hybrid.checkpointing.inspect import compare_with_checkpoint, sharded_tensor_shapes
from megatron_hybrid.checkpointing.settings import mismatched_flags
from megatron_hybrid.checkpointing.store import read_common
from megatron_hybrid.hf.api import stack_spec_for
from megatron_hybrid.pattern import GDN, parse_pattern
from megatron_hybrid.process_groups import init_world, initialize_model_parallel
from megatron_hybrid.runtime import RuntimeBackend, prefer_expandable_segments, select_backend
from megatron_hybrid.schedule.graphs import graphs_digest
from megatron_hybrid.training import resume
from megatron_hybrid.training.arguments import model_setting_dests, spec_backend
from megatron_hybrid.training.checkpoint import consumed_samples, load_checkpoint, save_checkpoint
from megatron_hybrid.training.collection import ManualCollection
from megatron_hybrid.training.config import hybrid_config_from_args
from megatron_hybrid.training.evaluation import evaluate
from megatron_hybrid.training.fusions import apply_gpu_fusions
from megatron_hybrid.training.guard import check_step, describe
from megatron_hybrid.training.hf_source import hf_source, hf_training_config, load_initial_weights
from megatron_hybrid.training.hf_source import model_kwargs as hf_model_kwargs
from megatron_hybrid.training.inputs import (
    RunInputs,
    StepFeed,
    data_change_notes,
    data_record,
    resolve_data,
)
from megatron_hybrid.training.loop import build_model_chunks, train_step
from megatron_hybrid.training.lora import check_resumable, lora_run, parameter_counts
from megatron_hybrid.training.lora_rules import validate_lora_flags
from megatron_hybrid.training.metrics import MetricsLog, ProgressLine, TrainingSummary
from megatron_hybrid.training.optimizers import build_optimizer
from megatron_hybrid.training.param_order import EXPERTS_ORDER, order_to_resume
from megatron_hybrid.training.save_target import (
    SaveTarget,
    check_save_sources,
    decide_save_target,
)
from megatron_hybrid.training.schedule import (
    SCHEDULER_KEY,
    build_scheduler,
    current_lr,
    resolve_schedule,
    restore_scheduler,
)
from megatron_hybrid.training.throughput import (
    PEAK_ENV,
    DevicePeak,
    StepFlops,
    device_peak,
    tflops_per_gpu,
    throughput_text,
)
from megatron_hybrid.training.train_settings import TrainSettings, require_settings
from megatron_hybrid.training.validation import validate_settings

__all__ = [
    "TrainingError",
    "build_chunks",
    "check_resume_compatible",
    "model_config",
    "parallel_setup",
    "recorded_settings",
    "run_training",
]


class TrainingError(ValueError):
    """A setting or input that prevents training; printed as one message (exit code 2)."""


def check_resume_compatible(chunks, folder, args: TrainSettings | None = None) -> None:
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


@dataclass(frozen=True)
class _Setup:
    """What the training loop needs, built by :func:`run_training` before the first step.

    ``args`` are the effective settings: the flags, with a Hugging Face source's architecture in
    place of the model flags; ``load`` what to resume (None for a weights-only start).
    """

    args: TrainSettings
    load: str | None
    backend: RuntimeBackend
    config: object
    pg: object
    rank: int
    global_batch: int
    num_microbatches: int
    seq_length: int
    inputs: RunInputs
    autotunes: bool
    lora: object = None
    peak: DevicePeak | None = None


def run_training(args: TrainSettings, backend: RuntimeBackend | None = None) -> TrainingSummary:
    """Train the model ``args`` describe; see ``python -m megatron_hybrid train --help``.

    Args:
        args: the ``train`` flags, typed (:func:`~megatron_hybrid.training.train_settings.
            settings_from_args` of the parsed namespace).
        backend: where to run (the CLI passes its choice); by default CUDA when a GPU is
            visible, else the CPU emulation.

    Raises:
        TypeError: ``args`` is not :class:`~megatron_hybrid.training.train_settings.
            TrainSettings` (a parsed namespace).
    """
    args = require_settings(args, "run_training")
    prefer_expandable_segments()  # before CUDA starts: variable-length batches fragment memory
    validate_lora_flags(args)  # first: they decide where the model comes from
    lora = lora_run(args)  # adapters on a frozen base: where it comes from, what resumes
    # --load-hf (or a LoRA base): the architecture comes from the Hugging Face config
    source = lora.source() if lora is not None else hf_source(args)
    if source is not None:
        args = source.applied_to(args)  # the conversion's settings, validated and read below
    # The tokenizer (--load-hf's by default), the vocabulary and the data files; then the
    # learning-rate schedule's defaults, which depend on whether the run fine-tunes.
    args = resolve_data(
        args,
        hf_folder=source.hf_path if source is not None else None,
        vocab_from="the Hugging Face model's" if source is not None else None,
    )
    fine_tuning = source is not None or lora is not None
    args = resolve_schedule(args, fine_tuning=fine_tuning, lora=lora is not None)
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
    inputs = RunInputs(args, config, pg, parsed, global_batch=global_batch,
                       device=backend.device(), on_gpu=backend.on_gpu)  # fmt: skip
    seq_length = inputs.seq_length
    load = args.load if lora is not None or not (source and source.checkpoint) else None
    point = _resume_point(load, args.save)
    # The distributed optimizer's state loads only into the buffer order that saved it.
    order = order_to_resume(point.folder)
    chunks = build_chunks(
        args, config, pg, parsed, source, seq_length, rank, lora=lora, param_order=order
    )
    optimizer = build_optimizer(
        chunks,
        config,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        pg=pg,
    )
    scheduler = build_scheduler(optimizer, args, global_batch)
    setup = _Setup(
        args=args,
        load=load,
        backend=backend,
        config=config,
        pg=pg,
        rank=rank,
        global_batch=global_batch,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        inputs=inputs,
        autotunes=autotunes,
        lora=lora,
        peak=peak,
    )
    start, consumed, resumed, notes = _resume(setup, point, chunks, optimizer, scheduler)
    settings = recorded_settings(args, seq_length)
    target = decide_save_target(args, start, resumed, settings, lora=lora is not None)
    inputs.open(consumed=consumed, start=start, evaluate=bool(args.eval_interval))
    counts = parameter_counts(chunks, pg)  # collective: before rank 0 alone prints
    if rank == 0:
        print(_start_line(setup, world, start, counts), flush=True)
        print(inputs.describe(), flush=True)
        for note in notes:
            print(note, flush=True)
    return _train(setup, chunks, optimizer, scheduler, start, consumed, target)


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


def model_config(args: TrainSettings, source, backend: RuntimeBackend):
    """The TransformerConfig, built once: from the flags, or from the Hugging Face source's
    conversion and the training flags."""
    overrides = backend.config_overrides()
    if source is not None:
        config = hf_training_config(source, args, **overrides)
    else:
        config = hybrid_config_from_args(args, **overrides)
    if backend.on_gpu:  # megatron's fused SwiGLU, cross-entropy and wgrad add, where exact
        apply_gpu_fusions(config, gradient_accumulation_fusion=args.gradient_accumulation_fusion)
    return config


def parallel_setup(args: TrainSettings, config, world: int):
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


def build_chunks(
    args: TrainSettings,
    config,
    pg,
    parsed,
    source,
    seq_length: int,
    rank: int,
    *,
    lora=None,
    param_order: str = EXPERTS_ORDER,
) -> list:
    """The model chunks of this rank, initialised from the Hugging Face source if any, with
    the LoRA adapters of ``lora`` (a :class:`~megatron_hybrid.training.lora.LoRARun`), their
    buffers in ``param_order`` (:mod:`~megatron_hybrid.training.param_order`)."""
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
        param_order=param_order,
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


def _resume_point(load: str | None, save: str | None):
    """What to resume (collective; :func:`~megatron_hybrid.training.resume.prepare_resume`)."""
    try:
        return resume.prepare_resume(load, save)
    except FileNotFoundError as error:
        raise TrainingError(str(error)) from None


def _resume(setup: _Setup, point, chunks, optimizer, scheduler) -> tuple[int, int, object, list]:
    """Load ``point`` (:func:`_resume_point`) if it names a checkpoint: ``(start iteration,
    consumed samples, the folder resumed from or None, notes)``; the learning-rate schedule
    continues from the checkpoint's."""
    args = setup.args
    for note in point.notes if setup.rank == 0 else ():
        print(note, flush=True)
    if point.folder is None:
        return 0, 0, None, []
    folder = point.folder
    if setup.lora is not None:
        check_resumable(setup.lora, chunks, folder)
    else:
        check_resume_compatible(chunks, folder, args)
    start = load_checkpoint(folder, chunks, optimizer, layout=resume.layout_of(setup.pg))
    resume.check_target(start, args.train_iters, folder)
    consumed = consumed_samples(folder)
    consumed = start * setup.global_batch if consumed is None else consumed
    common = read_common(folder)
    notes = [f"resumed from {folder} at iteration {start}"]
    saved = common.get(SCHEDULER_KEY)
    if saved is None:  # a checkpoint from before the schedule was recorded
        scheduler.step(increment=consumed)
        notes.append(f"{folder} records no learning-rate schedule: it continues at sample "
                     f"{consumed:,} of this run's")  # fmt: skip
    else:
        notes += restore_scheduler(scheduler, saved, args, setup.global_batch)
    notes += data_change_notes(common.get("data"), args, folder, consumed)
    return start, consumed, folder, notes


def recorded_settings(args: TrainSettings, seq_length: int) -> dict:
    """The model settings a checkpoint records (``model_setting_dests``), as this run used
    them: ``--max-position-embeddings`` defaults to the sequence length here."""
    settings = {dest: getattr(args, dest) for dest in model_setting_dests()}
    settings["max_position_embeddings"] = args.max_position_embeddings or seq_length
    return settings


def _train(
    setup: _Setup, chunks, optimizer, scheduler, start: int, consumed: int, target: SaveTarget
) -> TrainingSummary:
    """The steps from ``start`` to ``--train-iters``, with evaluations and periodic and final
    saves (the first one replacing what ``--save`` held where ``target`` says so); returns the
    :class:`TrainingSummary`."""
    args, rank, inputs = setup.args, setup.rank, setup.inputs
    progress = ProgressLine(args.train_iters, enabled=rank == 0, interval=args.log_interval)
    metrics = MetricsLog(args.log_dir or args.save, args.tensorboard_dir, start=start,
                         enabled=rank == 0, title=_curve_title(setup))  # fmt: skip
    gpus = torch.distributed.get_world_size() if setup.backend.on_gpu else 0
    summary = TrainingSummary(start, args.train_iters, [], [], None, gpus=gpus, peak=setup.peak)
    saved = None
    counter = StepFlops(setup.config, parse_pattern(args.hybrid_layer_pattern), args.vocab_size)
    seq_length, rows = inputs.step_shape
    # --manual-gc: no automatic collection inside the loop (restored after it).
    collector = ManualCollection(
        args.manual_gc, args.manual_gc_interval, not args.no_manual_gc_eval
    )

    feed = StepFeed(
        lambda first: counter.annotate(
            inputs.micro_batches(inputs.train, first, setup.num_microbatches)
        ),
        consumed,
        setup.global_batch,
    )
    with collector:
        for iteration in range(start, args.train_iters):
            batches = feed.take()
            # The next step's micro-batches are built while the GPU runs this one.
            following = None if iteration + 1 == args.train_iters else feed.build_next
            lr = current_lr(optimizer)
            began = time.perf_counter()
            result = train_step(chunks, optimizer, batches, setup.config, seq_length=seq_length,
                                micro_batch_size=rows, pg_collection=setup.pg,
                                while_queued=following)  # fmt: skip
            setup.backend.synchronize()
            elapsed = time.perf_counter() - began
            consumed += setup.global_batch
            done = iteration + 1
            if check_step(result, done, args.on_nonfinite, saved):
                if rank == 0:
                    print(f"step {done}: {describe(result)}: skipped", flush=True)
            else:
                scheduler.step(increment=setup.global_batch)  # as Megatron-LM: applied steps only
                rate = result.tokens / elapsed
                summary.step_seconds.append(elapsed)
                summary.step_tokens.append(result.tokens)
                summary.step_flops.append(result.flops)
                summary.losses.append(result.loss)
                summary.grad_norms.append(result.grad_norm)
                summary.learning_rates.append(lr)
                tflops = tflops_per_gpu([result.flops], [elapsed], gpus) if gpus else None
                progress.update(done, result.loss, lr, result.grad_norm, rate,
                                throughput_text(tflops, setup.peak))  # fmt: skip
                metrics.step(done, loss=result.loss, lr=lr, grad_norm=result.grad_norm,
                             tokens_per_second=rate, tflops_per_gpu=tflops)  # fmt: skip
            collector.after_step(done)
            if args.hybrid_cuda_graphs and iteration == start:
                progress.note(f"CUDA graphs: {graphs_digest(chunks)}")
            if setup.autotunes and iteration == start:
                progress.note(
                    f"first step took {elapsed:.0f} s with fla's kernel autotuning "
                    "(cached by Triton for the next runs: TRITON_CACHE_AUTOTUNING=1)"
                )
            if args.eval_interval and (done % args.eval_interval == 0 or done == args.train_iters):
                collector.before_eval()
                loss = _evaluate(setup, chunks, seq_length, rows)
                collector.after_eval()
                summary.validation_losses.append((done, loss))
                metrics.validation(done, loss)
                progress.note(f"iteration {done}: validation loss {loss:.4f}")
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
                        common={SCHEDULER_KEY: scheduler.state_dict(), "data": data_record(args)},
                    )
                )
                if done != args.train_iters:  # the final save is in the summary line
                    progress.note(f"saved {saved}")
    progress.close()
    note = metrics.close()
    if note:
        print(note, flush=True)
    return dataclasses.replace(summary, saved=saved)


def _evaluate(setup: _Setup, chunks, seq_length: int, rows: int) -> float:
    """The validation loss over the first ``--eval-iters`` global batches of the split."""
    inputs, step = setup.inputs, setup.global_batch
    batches = (
        inputs.micro_batches(inputs.valid, k * step, setup.num_microbatches)
        for k in range(setup.args.eval_iters)
    )
    return evaluate(chunks, batches, setup.config, seq_length=seq_length,
                    micro_batch_size=rows, pg=setup.pg)  # fmt: skip


def _curve_title(setup: _Setup) -> str:
    data = setup.args.data_path
    return f"{setup.args.hybrid_layer_pattern} on {' '.join(data) if data else 'synthetic data'}"

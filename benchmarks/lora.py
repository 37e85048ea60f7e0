"""LoRA against full fine-tuning on one device, and adapter weight sync.

    python benchmarks/lora.py --out benchmarks/results                 # one GPU, bf16
    python benchmarks/lora.py --preset tiny --sync-preset tiny --device cpu   # a quick check

Four measurements, each in its own process (so that peak memory is that run's alone):

* ``full`` and ``lora``: training steps of a Qwen3.5-MoE-shaped model (the ``qwen35moe-2b``
  preset: hidden 2048, ``([GE]{3}[*E]){2}``, 64 experts of 512, vocab 151936: 2.5 B
  parameters) in bf16 with megatron's DDP and distributed optimizer, as ``train`` runs them:
  full fine-tuning, and rank-16 LoRA on every linear (``all-linear``, base frozen). Median step
  time after a warm-up step, and the peak device memory of the run (weights, gradients,
  optimizer state, activations).
* in the ``lora`` run also: ``iter_lora_weights`` over the whole adapter (PEFT format), and the
  base stream ``iter_hf_weights`` plain against ``merge_lora=True`` (GB/s of tensors yielded as
  views, as RL weight sync consumes them).
* ``sync``: adapter-only sync of a rank-16 adapter on a Qwen3.5-35B-A3B-shaped model
  (``qwen35moe-35b-a3b``: hidden 2048, 40 layers, 256 experts of 512): the base is built on the
  meta device (shapes only, no memory), the adapters on the device; ``iter_lora_weights`` time
  for the whole adapter, after a first call that builds its plan.

GatedDeltaNet runs megatron-core's torch path (``deterministic_mode``) on GPUs, since fla's
backward needs Triton >= 3.7.1 on Hopper. Writes ``lora_<device>.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import qwen3_5_moe_text_config, recorded_command, sync

_COMMON = dict(
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
)  # fmt: skip
PRESETS = {
    "qwen35moe-2b": dict(
        hidden_size=2048, num_hidden_layers=8, num_experts=64, vocab_size=151936, **_COMMON
    ),
    "qwen35moe-35b-a3b": dict(
        hidden_size=2048, num_hidden_layers=40, num_experts=256, vocab_size=248320, **_COMMON
    ),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=48, vocab_size=256,
    ),
}  # fmt: skip


def _setup(device):
    from megatron_hybrid.process_groups import init_world, initialize_model_parallel
    from megatron_hybrid.runtime import select_backend

    backend = select_backend("cpu" if device.type == "cpu" else "cuda")
    backend.activate()
    init_world()
    return backend, initialize_model_parallel(seed=1)


def _batches(count: int, mbs: int, seq: int, vocab: int, device) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(1, vocab, (mbs, seq + 1), generator=generator)
        out.append(
            dict(
                input_ids=tokens[:, :-1].contiguous().to(device),
                labels=tokens[:, 1:].contiguous().to(device),
                position_ids=torch.arange(seq, device=device).expand(mbs, seq).contiguous(),
                loss_mask=torch.ones(mbs, seq, device=device),
                attention_mask=None,
                num_tokens=mbs * seq,
            )
        )
    return out


def _stream(stream) -> tuple[float, int, int]:
    """Consume a ``(name, tensor)`` stream: seconds, bytes, tensors."""
    began = time.perf_counter()
    total = count = 0
    for _, tensor in stream:
        total += tensor.numel() * tensor.element_size()
        count += 1
    return time.perf_counter() - began, total, count


def train_worker(mode: str, args) -> dict:
    """Steps of full fine-tuning or LoRA (and, for LoRA, the weight streams)."""
    from megatron_hybrid.hf import iter_hf_weights
    from megatron_hybrid.hf.api import stack_spec_for
    from megatron_hybrid.hf.config import hf_config_to_megatron
    from megatron_hybrid.peft import LoRAConfig, apply_lora, iter_lora_weights
    from megatron_hybrid.training.loop import build_model_chunks, train_step
    from megatron_hybrid.training.lora import parameter_counts
    from megatron_hybrid.training.optimizers import build_optimizer

    device = torch.device(args.device)
    backend, pg = _setup(device)
    conversion = hf_config_to_megatron(qwen3_5_moe_text_config(PRESETS[args.preset], 8192))
    config = conversion.transformer_config(
        **{
            **backend.config_overrides(),
            "bf16": True,
            "params_dtype": torch.bfloat16,
            "pipeline_dtype": torch.bfloat16,
            "deterministic_mode": True,
        }
    )
    kwargs = dict(conversion.model_kwargs)
    vocab, length = kwargs.pop("vocab_size"), kwargs.pop("max_sequence_length")
    for name in ("share_embeddings_and_output_weights", "position_embedding_type"):
        kwargs.pop(name)
    lora = LoRAConfig(rank=args.rank, alpha=2 * args.rank)

    def prepare(models):
        for model in models:
            model.module.hf_conversion = conversion
        apply_lora(models, lora, conversion=conversion)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    chunks = build_model_chunks(
        config,
        conversion.pattern,
        pg,
        backend="local",
        stack_spec=stack_spec_for(conversion, "local", config),
        vocab_size=vocab,
        max_sequence_length=length,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        prepare=prepare if mode == "lora" else None,
        **kwargs,
    )
    optimizer = build_optimizer(chunks, config, lr=1e-5, weight_decay=0.0, clip_grad=1.0, pg=pg)
    trainable, total = parameter_counts(chunks, pg)
    batches = _batches(args.microbatches, 1, args.seq_length, vocab, device)
    seconds = []
    for _ in range(args.steps + 1):
        sync(device)
        began = time.perf_counter()
        train_step(chunks, optimizer, batches, config, seq_length=args.seq_length,
                   micro_batch_size=1, pg_collection=pg)  # fmt: skip
        sync(device)
        seconds.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    result = dict(
        mode=mode,
        trainable=trainable,
        parameters=total,
        step_seconds=seconds[1:],
        warmup_seconds=seconds[0],
        step_median=statistics.median(seconds[1:]),
        peak_bytes=peak,
    )
    if mode == "lora":
        model = chunks[0]
        for key, stream in (
            ("adapter", lambda: iter_lora_weights(model)),
            ("plain", lambda: iter_hf_weights(model, merge_lora=False)),
            ("merged", lambda: iter_hf_weights(model, merge_lora=True)),
        ):
            rounds = [_stream(stream()) for _ in range(args.repeats + 1)][1:]
            sync(device)
            result[key] = dict(
                seconds_median=statistics.median(r[0] for r in rounds),
                bytes=rounds[0][1],
                tensors=rounds[0][2],
                gb_per_s=statistics.median(r[1] / r[0] / 1e9 for r in rounds),
            )
    return result


@contextlib.contextmanager
def _meta_base(device):
    """Modules built inside get their parameters on the meta device (megatron allocates on
    ``torch.cuda.current_device()``, which is pointed there too)."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.cuda.current_device = original


def sync_worker(args) -> dict:
    """Adapter-only sync of a 35B-A3B-shaped model: base on the meta device, adapters real."""
    from megatron_hybrid.hf.api import stack_spec_for
    from megatron_hybrid.hf.config import hf_config_to_megatron
    from megatron_hybrid.model import HybridModel
    from megatron_hybrid.peft import LoRAConfig, apply_lora, iter_lora_weights, lora_parameters
    from megatron_hybrid.peft.apply import adapters

    device = torch.device(args.device)
    backend, pg = _setup(device)
    conversion = hf_config_to_megatron(qwen3_5_moe_text_config(PRESETS[args.sync_preset], 8192))
    config = conversion.transformer_config(
        **{
            **backend.config_overrides(),
            "bf16": True,
            "params_dtype": torch.bfloat16,
            "perform_initialization": False,
        }
    )
    kwargs = dict(conversion.model_kwargs)
    began = time.perf_counter()
    with _meta_base(device):
        model = HybridModel(
            config,
            stack_spec_for(conversion, "local", config),
            vocab_size=kwargs.pop("vocab_size"),
            max_sequence_length=kwargs.pop("max_sequence_length"),
            hybrid_layer_pattern=conversion.pattern.pattern,
            pg_collection=pg,
            **kwargs,
        )
    model.hf_conversion = conversion
    apply_lora(model, LoRAConfig(rank=args.rank, alpha=2 * args.rank))
    for adapter in adapters(model):  # the adapters on the device, the base stays shapes only
        adapter.to_empty(device=device)
    with torch.no_grad():
        for param in lora_parameters(model):
            param.normal_(0, 0.02)
    setup = time.perf_counter() - began
    base = sum(p.numel() for p in model.parameters())
    sync(device)
    first = _stream(iter_lora_weights(model, device=device))
    rounds = [_stream(iter_lora_weights(model, device=device)) for _ in range(args.repeats)]
    sync(device)
    return dict(
        preset=args.sync_preset,
        parameters=base,
        adapter_parameters=sum(p.numel() for p in lora_parameters(model)),
        setup_seconds=setup,
        first_seconds=first[0],
        seconds_median=statistics.median(r[0] for r in rounds),
        seconds=[r[0] for r in rounds],
        bytes=first[1],
        tensors=first[2],
    )


def _run_worker(part: str, argv: list[str], timeout: float) -> dict:
    """One measurement in a fresh process (its own peak memory)."""
    command = [sys.executable, __file__, *argv, "--worker", part]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    for line in done.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
    raise RuntimeError(f"worker {part} failed (exit {done.returncode}):\n{tail}")


def _table(result: dict) -> str:
    full, lora, sync = result["full"], result["lora"], result["sync"]
    gib = 2**30

    def mem(run):
        return "n/a (CPU)" if run["peak_bytes"] is None else f"{run['peak_bytes'] / gib:.2f} GiB"

    lines = [
        f"# LoRA vs full fine-tuning ({result['date']}, {result['device']})",
        "",
        f"`{result['command']}`: {result['preset']} ({full['parameters'] / 1e9:.2f} B "
        f"parameters), bf16, rank {result['rank']} on all linears, sequence "
        f"{result['seq_length']}, {result['microbatches']} micro-batch(es) per step, median of "
        f"{result['steps']} steps after a warm-up step.",
        "",
        "| run | trainable parameters | step time | peak memory |",
        "| --- | --- | --- | --- |",
    ]
    for name, run in (("full fine-tuning", full), ("LoRA", lora)):
        lines.append(
            f"| {name} | {run['trainable'] / 1e6:,.1f} M | {run['step_median'] * 1e3:.1f} ms | "
            f"{mem(run)} |"
        )
    lines += [
        "",
        "| stream (LoRA run) | tensors | GB | s | GB/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in ("adapter", "plain", "merged"):
        s = lora[key]
        lines.append(
            f"| {key} | {s['tensors']} | {s['bytes'] / 1e9:.3f} | {s['seconds_median']:.4f} | "
            f"{s['gb_per_s']:.1f} |"
        )
    lines += [
        "",
        f"Adapter-only sync, {sync['preset']} ({sync['parameters'] / 1e9:.1f} B parameters, "
        f"base on the meta device): rank-{result['rank']} adapter of "
        f"{sync['adapter_parameters'] / 1e6:,.0f} M parameters, {sync['tensors']} tensors, "
        f"{sync['bytes'] / 1e9:.2f} GB: `iter_lora_weights` {sync['seconds_median']:.3f} s "
        f"(first call, which builds the plan: {sync['first_seconds']:.2f} s).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen35moe-2b")
    parser.add_argument("--sync-preset", choices=sorted(PRESETS), default="qwen35moe-35b-a3b")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="stream rounds")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per measurement")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results files")
    parser.add_argument("--worker", choices=["full", "lora", "sync"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rank, args.steps, args.repeats, args.microbatches) < 1:
        parser.error("--rank, --steps, --repeats and --microbatches must be >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.worker:
        result = sync_worker(args) if args.worker == "sync" else train_worker(args.worker, args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    worker_argv = [a for a in argv if a != "--out"]
    if args.out is not None:
        worker_argv = [a for i, a in enumerate(argv) if a != "--out" and argv[i - 1] != "--out"]
    worker_argv += ["--device", args.device]
    result = dict(
        benchmark="lora",
        date=datetime.date.today().isoformat(),
        command=recorded_command("lora.py", argv),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        preset=args.preset,
        rank=args.rank,
        seq_length=args.seq_length,
        microbatches=args.microbatches,
        steps=args.steps,
    )
    for part in ("full", "lora", "sync"):
        result[part] = _run_worker(part, worker_argv, args.timeout)
    text = _table(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"lora_{result['device'].replace(' ', '-')}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput and memory of ``iter_hf_weights`` (what RL weight sync consumes), one device.

    python benchmarks/hf_export.py --out benchmarks/results            # GPU if there is one
    python benchmarks/hf_export.py --quantize fp8 --out benchmarks/results
    python benchmarks/hf_export.py --preset tiny --device cpu          # a quick check

Builds a Qwen3.5-MoE-shaped model (the ``qwen35moe-3b`` preset: hidden 2048, 12 layers
``([GE]{3}[*E]){3}``, 64 experts of 512, vocab 151936: 3.3 B parameters) in bf16, with random
weights, and streams it out per round in each mode:

* ``views`` — consume each yielded tensor as it is (where the on-disk layout is a plain slice
  of a parameter, the tensor is a view and nothing is copied: the cost is the plan walk and the
  reorders that QKV and GatedDeltaNet need);
* ``copies`` — clone every yielded tensor into its own buffer, as a sender that must own its
  data does, and release it before the next one;
* ``fp8`` (``--quantize fp8``) — ``iter_hf_weights(quantize="fp8")``: the weights the
  Qwen3.5 FP8 release quantizes come out as ``float8_e4m3fn`` plus ``weight_scale_inv``
  (128 x 128 blocks, fused kernel on a GPU), a bucket at a time.

Reports GB/s of bf16 input (the bytes of the weights streamed, before quantization; medians
over ``--repeats`` rounds) and the peak device memory above the model during the stream,
against the largest single tensor yielded and, for ``fp8``, the bucket size (the target is
>= 100 GB/s with extra memory within one bucket). Writes ``hf_export[_fp8]_<device>.{json,md}``
to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import qwen3_5_moe_text_config, recorded_command, sync

PRESETS = {
    "qwen35moe-3b": dict(
        hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=64,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, vocab_size=256,
    ),
}  # fmt: skip


def measure(model, device, mode: str, bucket_size: str = "256MB") -> dict:
    """One streamed export: seconds, bytes of bf16 input, tensors, largest tensor, peak extra
    memory."""
    from megatron_hybrid.hf import iter_hf_weights

    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    total, count, largest = 0, 0, 0
    quantize = "fp8" if mode == "fp8" else "none"
    began = time.perf_counter()
    stream = iter_hf_weights(model, device=device, quantize=quantize, bucket_size=bucket_size)
    for name, tensor in stream:
        if mode == "copies":
            tensor = tensor.clone()
        if name.endswith("_scale_inv"):
            del tensor
            continue
        # bytes of the weight as the model holds it (an FP8 one was bf16 before quantization)
        size = tensor.numel() * (
            2 if tensor.dtype == torch.float8_e4m3fn else tensor.element_size()
        )
        total, count, largest = total + size, count + 1, max(largest, size)
        del tensor
    sync(device)
    seconds = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return dict(seconds=seconds, bytes=total, tensors=count, largest=largest, peak_extra=peak)


def profile_round(model, device, bucket_size: str) -> dict:
    """One more FP8 round under torch.profiler: where its wall time goes (host or GPU) and
    its kernels (``trace_summary.py``)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function
    from trace_summary import kernel_breakdown, summarize_trace

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mh_step"):
            measure(model, device, "fp8", bucket_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return dict(summary=summarize_trace(events), kernels=kernel_breakdown(events, top=8))


def profile_lines(found: dict) -> list[str]:
    """Markdown of :func:`profile_round` (profiled, so slower than the timed rounds)."""
    summary = found["summary"]
    lines = [
        "",
        f"Profiled FP8 round: {summary['window_ms']:.1f} ms, GPU busy "
        f"{summary['gpu_busy_ms']:.1f} ms, {summary['compute_kernels']} kernels, "
        f"{summary['cpu_launches']} launches.",
        "",
        "| kernel | category | ms | count | mean µs |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for k in found["kernels"]["kernels"]:
        lines.append(f"| `{k['name'][:90]}` | {k['category']} | {k['ms']:.2f} | {k['count']} | "
                     f"{k['mean_us']:.1f} |")  # fmt: skip
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen35moe-3b")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default: %(default)s)")
    parser.add_argument(
        "--quantize",
        choices=["none", "fp8"],
        default="none",
        help="none: modes views and copies; fp8: FP8 quantization, with views as the baseline "
        "on the same machine (default: %(default)s)",
    )
    parser.add_argument("--bucket-size", default="256MB", help="FP8 bucket (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results files")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else
        ("cpu" if args.device == "auto" else args.device)
    )  # fmt: skip
    if device.type == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu on a CUDA machine is not supported (CPU emulation refuses it)")

    from megatron_hybrid.hf.api import build_model
    from megatron_hybrid.hf.config import hf_config_to_megatron
    from megatron_hybrid.hf.io import parse_size
    from megatron_hybrid.process_groups import init_world, initialize_model_parallel
    from megatron_hybrid.runtime import select_backend

    conversion = hf_config_to_megatron(qwen3_5_moe_text_config(PRESETS[args.preset], 4096))
    select_backend("cpu" if device.type == "cpu" else "cuda").activate()
    init_world()
    pg = initialize_model_parallel()
    model = build_model(conversion, pg, perform_initialization=False).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # FP8 scales are computed from the values
            param.normal_(0.0, 0.02, generator=generator)
    params = sum(p.numel() for p in model.parameters())
    modes = ["views", "fp8"] if args.quantize == "fp8" else ["views", "copies"]
    rows = {mode: [] for mode in modes}
    for mode in modes:  # warm-up: the plan, the kernel's compilation
        measure(model, device, mode, args.bucket_size)
    for _ in range(args.repeats):
        for mode in rows:
            rows[mode].append(measure(model, device, mode, args.bucket_size))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    result = dict(
        benchmark="hf_export",
        date=datetime.date.today().isoformat(),
        command=recorded_command("hf_export.py", argv if argv is not None else sys.argv[1:]),
        device=name,
        preset=args.preset,
        parameters=params,
        bucket_bytes=parse_size(args.bucket_size) if args.quantize == "fp8" else None,
        modes={},
    )
    for mode, runs in rows.items():
        gbps = [r["bytes"] / r["seconds"] / 1e9 for r in runs]
        peaks = [r["peak_extra"] for r in runs if r["peak_extra"] is not None]
        result["modes"][mode] = dict(
            gb_per_s_median=statistics.median(gbps),
            gb_per_s=gbps,
            seconds_median=statistics.median(r["seconds"] for r in runs),
            bytes=runs[0]["bytes"],
            tensors=runs[0]["tensors"],
            largest_tensor_bytes=runs[0]["largest"],
            peak_extra_bytes=max(peaks) if peaks else None,
        )
    bucket = f", FP8 bucket {result['bucket_bytes'] / 1e6:.0f} MB" if result["bucket_bytes"] else ""
    lines = [
        f"# iter_hf_weights export ({result['date']}, {name})",
        "",
        f"`{result['command']}`: {args.preset}, {params / 1e9:.2f} B parameters, bf16, "
        f"{args.repeats} rounds (medians){bucket}. GB/s and GB count the weights in bf16.",
        "",
        "| mode | GB/s | s | GB (bf16) | tensors | peak extra memory | largest tensor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in result["modes"].items():
        peak = (
            "n/a (CPU)"
            if m["peak_extra_bytes"] is None
            else f"{m['peak_extra_bytes'] / 1e6:.1f} MB"
        )
        lines.append(
            f"| {mode} | {m['gb_per_s_median']:.1f} | {m['seconds_median']:.3f} | "
            f"{m['bytes'] / 1e9:.2f} | {m['tensors']} | {peak} | "
            f"{m['largest_tensor_bytes'] / 1e6:.1f} MB |"
        )
    if device.type == "cuda" and "fp8" in rows:
        result["fp8_profile"] = profile_round(model, device, args.bucket_size)
        lines += profile_lines(result["fp8_profile"])
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        kind = "hf_export_fp8" if args.quantize == "fp8" else "hf_export"
        stem = f"{kind}_{name.replace(' ', '-')}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

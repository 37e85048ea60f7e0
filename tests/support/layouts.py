"""``forward_logprobs`` and packed == separate on parallel layouts: one comparison for the CPU
unit suite (two gloo ranks, ``tests/unit/logprobs/test_forward_logprobs.py``) and the GPU suite
(NCCL, ``tests/functional/test_packing_gpu.py``).

A TP1 model of ``train``'s flags is saved with ``dist_checkpointing``; every layout of
:data:`LAYOUTS` that fits the job loads it and computes ``forward_logprobs`` (packed THD
micro-batches through megatron-core's schedule, pipeline stages included), which must give the
TP1 model's log-probs and entropies of each sequence alone. At TP2 and EP2 the layout also runs
:func:`~support.packing.packing_errors` (packed logits against each sequence alone) for every
symbol the local backend builds. Controls: GatedDeltaNet told to ignore the sequence boundaries
(its state then runs from one sequence into the next) must miss both comparisons.
"""

from __future__ import annotations

import torch

from support.packing import pack_with_gaps, packing_errors

FLAGS = ("--swiglu", "--num-experts", "4", "--moe-router-topk", "2")
MLA = ("--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16")  # fmt: skip
#: Every symbol the local backend builds ('*' and '+' cannot share a model).
PATTERNS = {"attention": ("[*E][GE][M-][*-]", FLAGS), "mla": ("[+E][G-]", FLAGS + MLA)}
#: The attention pattern's layers over two pipeline stages, and over 2 x 2 virtual stages.
PIPED = {"pp2": "[*E][GE]|[M-][*-]", "pp2-vpp2": "[*E]|[GE]|[M-]|[*-]"}
LAYOUTS = {
    "tp2": dict(tp=2),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
    "pp2-vpp2": dict(pp=2, vpp=2),
}
#: The model has 128 output rows: 8 of them vocabulary padding.
VOCAB = 120


def train_config(pattern, *flags, **overrides):
    """``train``'s config of ``pattern`` and ``flags``, weights built on the CPU (the same seed
    gives the same weights in every layout) and CUDA fusions off."""
    from megatron_hybrid.runtime.cpu import cpu_config_overrides
    from megatron_hybrid.training.config import config_from_flags

    return config_from_flags(pattern, *flags, **{**cpu_config_overrides(), **overrides})


def layout_model(pg, pattern, *flags, vp_stage=None, device=None, **overrides):
    """A float32 model of ``train``'s ``flags`` (GatedDeltaNet memories long, so that a leak
    would not fade in the padding), on ``device``."""
    from megatron_hybrid.testing.models import build_hybrid

    config = train_config(pattern, *flags, **overrides)
    torch.manual_seed(0)
    model = build_hybrid(config, pattern, pg, vp_stage=vp_stage, max_sequence_length=256)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-4.0)
    return model if device is None else model.to(device)


def layout_flags(layout) -> tuple[str, ...]:
    """``train``'s flags of a :data:`LAYOUTS` entry."""
    flags = []
    if layout.get("tp"):
        flags += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    if layout.get("ep"):
        flags += ["--expert-model-parallel-size", "2"]
    if layout.get("pp"):
        flags += ["--pipeline-model-parallel-size", "2"]
    return tuple(flags)


def ignore_boundaries(model) -> int:
    """Negative control: GatedDeltaNet layers drop ``cu_seqlens`` (their state runs across
    sequences); the number of layers changed."""
    layers = [m for m in model.modules() if hasattr(m, "gated_delta_rule")]
    for layer in layers:
        rule = layer.gated_delta_rule
        layer.gated_delta_rule = lambda *a, r=rule, cu_seqlens=None, **k: r(*a, **k)
    return len(layers)


def _chunks(pg, pattern, flags, layout, device):
    vpp = layout.get("vpp", 0)
    chunks = [layout_model(pg, pattern, *flags, vp_stage=v, device=device) for v in range(vpp)]
    return chunks or [layout_model(pg, pattern, *flags, device=device)]


def _logprobs(chunks, sequences, rank, name):
    from megatron_hybrid.logprobs import forward_logprobs

    # Data-parallel ranks need not see the same sequences: at EP2 the others get them reversed.
    mine = sequences if rank == 0 or name != "ep2" else sequences[::-1]
    got = list(zip(*forward_logprobs(chunks if len(chunks) > 1 else chunks[0], mine,
                                     max_tokens_per_micro_batch=64, with_entropy=True,
                                     vocab_size=VOCAB), strict=True))  # fmt: skip
    got = got if mine is sequences else got[::-1]
    # Plain lists: tensors would travel through shared memory a spawned rank releases on exit.
    return [[p.float().cpu().tolist() for p in pair] for pair in got]


def run_layouts(rank, world_size, checkpoint, sequences, *, device=None, names=None) -> dict:
    """Per layout that ``world_size`` ranks host: forward_logprobs of the checkpoint's model (and
    with GatedDeltaNet ignoring the boundaries at PP2); at TP2 and EP2 also packing errors.

    Returns ``{layout: {"logprobs": ..., "leaking logprobs": ... (pp2), "errors": {...}}}``;
    errors are per sequence, by pattern, and ``"leaking"`` (the control).
    """
    from megatron_hybrid.hf.dist import load_model_state
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    out = {}
    for name, layout in LAYOUTS.items():
        if names is not None and name not in names:
            continue
        reset_megatron_state()
        pg = initialize_model_parallel(**layout)
        pattern = PIPED.get(name, PATTERNS["attention"][0])
        flags = FLAGS + layout_flags(layout)
        chunks = _chunks(pg, pattern, flags, layout, device)
        load_model_state(chunks, checkpoint)
        out[name] = {"logprobs": _logprobs(chunks, sequences, rank, name)}
        if name == "pp2":
            changed = sum(ignore_boundaries(c) for c in chunks)
            out[name]["leaking logprobs"] = _logprobs(chunks, sequences, rank, name)
            out[name]["leaking layers"] = changed
        if name in ("tp2", "ep2"):
            errors = {}
            for key, (p, f) in PATTERNS.items():
                model = layout_model(pg, p, *f, *layout_flags(layout), device=device).eval()
                errors[key] = packing_errors(
                    model, sequences, pack_with_gaps(sequences, tp=2), align=2
                )
            ignore_boundaries(model)
            errors["leaking"] = packing_errors(
                model, sequences, pack_with_gaps(sequences, tp=2), align=2
            )
            out[name]["errors"] = errors
    reset_megatron_state()
    return out


def max_error(got, want) -> float:
    """Largest abs difference between two lists of per-sequence ``(logprobs, entropies)``."""
    return max(
        (
            (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max().item()
            if len(a)
            else 0.0
        )
        for pair_got, pair_want in zip(got, want, strict=True)
        for a, b in zip(pair_got, pair_want, strict=True)
    )

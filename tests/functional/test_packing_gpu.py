"""Packed (THD) == separate on GPUs, with the kernels that pack there.

``[*E][GE][M-][*-]`` and ``[+E][G-]`` (every symbol the backends build here; ``D`` needs a DSA
configuration the small test models do not have) run five sequences packed into one THD row
with alignment padding between them, and each sequence alone, at TP1 (and, for the ``te``
backend, TP2 with SP and EP2). With two or more GPUs the comparison the CPU suite runs on gloo
(``support.layouts``) runs on NCCL: a TP1 checkpoint loaded at TP2 + SP, EP2, PP2 and
PP2 x VPP2 gives the TP1 model's ``forward_logprobs`` (packed micro-batches through the
schedule: packed == separate through pipeline stages too), and packed == separate holds at TP2
and EP2 for both patterns; GatedDeltaNet told to ignore the boundaries must miss both.
GatedDeltaNet runs fla's ``causal_conv1d`` and ``chunk_gated_delta_rule``
with ``cu_seqlens`` (megatron-core's own THD path), Mamba megatron-core's kernels where
mamba_ssm is installed (else the torch Mamba2 path; the table says which), attention the
package's local core attention (float32, TF32 off, fla's float32 dots IEEE:
``TRITON_F32_DEFAULT=ieee``) or, when TransformerEngine is importable, TE's attention (bf16, which
TE's THD kernels need).

Bounds: float32 packs to 1e-4 (rounding of differently shaped kernels). bf16 is held to 4x the
noise of the same sequences run alone at two padded lengths (what a kernel's shape alone changes)
plus 2e-2. The control tells the model the row is one sequence (every state, conv window and mask
then runs across the boundaries) and must miss by at least 10x the bound.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # before fla compiles a kernel

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import ON_CPU, exact_float32, layout_fits, report  # noqa: E402
from support.layouts import LAYOUTS as PARALLEL_LAYOUTS  # noqa: E402
from support.layouts import PATTERNS as LAYOUT_PATTERNS  # noqa: E402
from support.layouts import VOCAB, layout_model, max_error, run_layouts  # noqa: E402
from support.packing import (  # noqa: E402
    pack_with_gaps,
    packing_errors,
    random_sequences,
)

FLAGS = ("--swiglu", "--num-experts", "4", "--moe-router-topk", "2")
MLA = ("--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16")  # fmt: skip
PATTERNS = {"[*E][GE][M-][*-]": FLAGS, "[+E][G-]": FLAGS + MLA}
LAYOUTS = {"tp1": {}, "tp2": dict(tp=2), "ep2": dict(ep=2)}
#: The local backend's TP2 and EP2 packing runs in test_layouts_match_tp1_and_pack_exactly.
LOCAL_LAYOUTS = ("tp1",)
FP32_BOUND = 1e-4
#: A leaking control must miss by this much (a leak moves logits by O(1)).
CONTROL = 10 * FP32_BOUND


def train_config(pattern, *flags, **overrides):
    """``train``'s config of ``pattern`` and ``flags``, with the CPU runtime's settings."""
    from megatron_hybrid.runtime.cpu import cpu_config_overrides
    from megatron_hybrid.training.config import config_from_flags

    return config_from_flags(pattern, *flags, **{**cpu_config_overrides(), **overrides})


def _have_te() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


def _mamba_path() -> str:
    from megatron_hybrid.modules.mamba_torch import mamba_kernels_available

    return "kernels" if mamba_kernels_available()[0] else "torch"


def _model(pattern, flags, backend, layout, pg, device):
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import build_hybrid

    extra = ["--transformer-impl", "transformer_engine", "--bf16"] if backend == "te" else []
    if layout.get("tp"):
        extra += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    if layout.get("ep"):
        extra += ["--expert-model-parallel-size", "2"]
    config = train_config(pattern, *flags, *extra)
    torch.manual_seed(0)
    model = build_hybrid(config, pattern, pg, backend=backend, max_sequence_length=256)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-4.0)  # long memories: a leak would not fade in the padding
    model = model.to(device).eval()
    return Float16Module(config, model) if backend == "te" else model


def _shape_noise(model, sequences, align: int) -> float:
    """How much each sequence's logits move between two padded lengths (kernel shapes only)."""
    device = next(model.parameters()).device
    worst = 0.0
    with torch.no_grad():
        for tokens in sequences:
            outs = []
            for width in (-(-len(tokens) // align) * align, -(-len(tokens) // 64) * 64 + 64):
                ids = torch.zeros(1, width, dtype=torch.long, device=device)
                ids[0, : len(tokens)] = tokens.to(device)
                pads = (torch.arange(width, device=device) >= len(tokens)).unsqueeze(0)
                positions = torch.arange(width, device=device).unsqueeze(0)
                outs.append(model(ids, positions, None, padding_mask=pads)[0, : len(tokens)])
            worst = max(worst, (outs[0].float() - outs[1].float()).abs().max().item())
    return worst


#: On a fresh machine the first of these tests compiles fla's float32 kernels (IEEE dots, packed
#: and unpacked variants), the layouts test again for TP2's halved heads: more than the suite
#: guard's default limit of 120 s may go into that, which is no hang.
COMPILES_FLA = pytest.mark.time_limit(240)


@COMPILES_FLA
@pytest.mark.parametrize("backend", ["local", "te"])
def test_packed_equals_separate_with_gpu_kernels(world, backend):
    from megatron_hybrid.process_groups import initialize_model_parallel

    rank, world_size, device = world
    if backend == "te" and not _have_te():
        pytest.skip("TransformerEngine is not importable (install it for the te backend)")
    if not ON_CPU and importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (GatedDeltaNet's kernels)")
    sequences = random_sequences(vocab_size=128, seed=3)
    rows = [("layout", "pattern", "worst packed error", "bound", "leaking control")]
    failures = []
    for name, layout in LAYOUTS.items():
        if backend == "local" and name not in LOCAL_LAYOUTS:
            continue
        if not layout_fits(world_size, **layout) or (layout and world_size < 2):
            rows.append((name, "skipped: needs 2 GPUs", "", "", ""))
            continue
        pg = initialize_model_parallel(**layout, seed=5)
        align = layout.get("tp", 1)
        for pattern, flags in PATTERNS.items():
            model = _model(pattern, flags, backend, layout, pg, device)
            packed = pack_with_gaps(sequences, tp=2)
            with exact_float32():
                errors = packing_errors(model, sequences, packed, align=align)
                leaked = packing_errors(model, sequences, packed, align=align, leak=True)
                bound = FP32_BOUND
                if backend == "te":
                    bound = 4 * _shape_noise(model, sequences, align) + 2e-2
            worst, control = max(errors), max(leaked[1:])
            rows.append((name, pattern, f"{worst:.2e}", f"{bound:.2e}", f"{control:.2e}"))
            if not worst <= bound:
                failures.append(f"{name} {pattern}: packed error {worst:.2e} > {bound:.2e}")
            # The deliberate leak must fail this very bound, clearly (bf16's floor is 2e-2).
            if not control >= 2 * bound:
                failures.append(f"{name} {pattern}: the leaking control moved only {control:.2e}")
    dtype = "bf16" if backend == "te" else "float32"
    report(f"packed == separate, {backend} backend, {dtype}, Mamba {_mamba_path()}, "
           f"{world_size} GPUs", rows)  # fmt: skip
    assert not failures, failures


def test_forward_logprobs_on_gpu_equals_each_sequence_alone(world):
    """forward_logprobs (packed micro-batches through megatron's schedule) at TP1, float32."""
    from megatron_hybrid.logprobs import forward_logprobs
    from megatron_hybrid.process_groups import initialize_model_parallel

    rank, world_size, device = world
    if not ON_CPU and importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (GatedDeltaNet's kernels)")
    pg = initialize_model_parallel(seed=5)
    pattern = "[*E][GE][M-][*-]"
    model = _model(pattern, PATTERNS[pattern], "local", {}, pg, device)
    sequences = random_sequences(vocab_size=128, seed=4)
    with exact_float32():
        got = zip(*forward_logprobs(model, sequences, max_tokens_per_micro_batch=48,
                                    with_entropy=True), strict=True)  # fmt: skip
        worst = 0.0
        with torch.no_grad():
            for tokens, (lp, entropy) in zip(sequences, got, strict=True):
                ids = tokens.to(device).unsqueeze(0)
                positions = torch.arange(len(tokens), device=device).unsqueeze(0)
                log_p = torch.log_softmax(model(ids, positions, None)[0].double(), -1)[:-1]
                want = log_p.gather(-1, ids[0, 1:, None]).squeeze(-1)
                want_h = -(log_p.exp() * log_p).sum(-1)
                if len(lp):
                    worst = max(worst, (lp - want).abs().max().item(),
                                (entropy - want_h).abs().max().item())  # fmt: skip
    report("forward_logprobs vs each sequence alone (float32, TP1)", [("max abs", f"{worst:.2e}")])
    assert worst < FP32_BOUND


@COMPILES_FLA
def test_layouts_match_tp1_and_pack_exactly(world, shared_dir):
    """TP2 + SP, EP2, PP2, PP2 x VPP2 from a TP1 checkpoint, float32 (see the module doc)."""
    from megatron.core import dist_checkpointing

    from megatron_hybrid.checkpointing.sharded import model_sharded_state
    from megatron_hybrid.logprobs import forward_logprobs
    from megatron_hybrid.process_groups import initialize_model_parallel

    rank, world_size, device = world
    if world_size < 2:
        pytest.skip("TP2, EP2 and PP2 need 2 or 4 GPUs; this job has 1")
    if not ON_CPU and importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (GatedDeltaNet's kernels)")
    names = [
        name
        for name, layout in PARALLEL_LAYOUTS.items()
        if layout_fits(world_size, **{k: v for k, v in layout.items() if k != "vpp"})
    ]
    pattern, flags = LAYOUT_PATTERNS["attention"]
    sequences = random_sequences(vocab_size=VOCAB, seed=5)
    with exact_float32():
        pg = initialize_model_parallel(seed=5)
        model = layout_model(pg, pattern, *flags, device=device).eval()
        lp, h = forward_logprobs(model, sequences, with_entropy=True, vocab_size=VOCAB)
        reference = [
            [a.float().cpu().tolist(), b.float().cpu().tolist()] for a, b in zip(lp, h, strict=True)
        ]
        dist_checkpointing.save(model_sharded_state([model]), shared_dir)
        results = run_layouts(rank, world_size, shared_dir, sequences, device=device, names=names)
    rows = [("layout", "forward_logprobs vs TP1", "packed vs alone", "leaking control")]
    failures = []
    for name in names:
        result = results[name]
        error = max_error(result["logprobs"], reference)
        packed, control = "", ""
        if not error <= FP32_BOUND:
            failures.append(f"{name}: log-probs {error:.2e} from TP1's > {FP32_BOUND:.0e}")
        if "leaking logprobs" in result:
            leak = max_error(result["leaking logprobs"], reference)
            control = f"{leak:.2e} (log-probs)"
            if not leak >= CONTROL:
                failures.append(f"{name}: the leaking control moved log-probs only {leak:.2e}")
        if "errors" in result:
            errors = result["errors"]
            worst, leak = max(errors["attention"] + errors["mla"]), max(errors["leaking"][1:])
            packed, control = f"{worst:.2e}", f"{leak:.2e} (logits)"
            if not worst <= FP32_BOUND:
                failures.append(f"{name}: packed logits {worst:.2e} from alone > {FP32_BOUND:.0e}")
            if not leak >= CONTROL:
                failures.append(f"{name}: the leaking control moved logits only {leak:.2e}")
        rows.append((name, f"{error:.2e}", packed, control))
    report(f"layouts vs TP1 (float32, TF32 off), {world_size} ranks, bound {FP32_BOUND:.0e}", rows)
    assert not failures, failures

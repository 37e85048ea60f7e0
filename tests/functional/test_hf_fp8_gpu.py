"""Block-scaled FP8 on GPUs: the fused quantize kernel against its torch reference, the FP8
fixture folders loaded (logits against transformers on their dequantized weights) and streamed
back bitwise, and a GPU-sized Qwen3.5-MoE-shaped model written as FP8 with the release recipe,
loaded from that folder and streamed back bitwise.

The fixture folders and transformers' logits are ``hf_fixtures.py``'s (folders ``*_fp8``, made
where transformers is importable; the ``hf_folders`` fixture); where they are missing those
tests skip with the reason. Every test runs on 1, 2 or
4 GPUs (the GPU-sized model spreads its experts over all of them).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import ON_CPU, exact_float32, report

FP8_FIXTURES = ("deepseek_v3_fp8", "qwen3_5_moe_fp8")

# A Qwen3.5-MoE-shaped model of 0.86 B parameters (1.7 GB in bf16): GPU-sized, yet written,
# read back and compared within a minute. Tiny on the CPU check.
GPU_SIZED = dict(
    hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, vocab_size=151936,
)  # fmt: skip
CPU_SIZED = dict(
    GPU_SIZED, hidden_size=128, num_experts=4, moe_intermediate_size=64, vocab_size=512,
    shared_expert_intermediate_size=64, num_hidden_layers=4, linear_num_key_heads=2,
    linear_num_value_heads=4, num_attention_heads=4,
)  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _weights(generator, shape, dtype, device):
    """Values spread over 2**-24 .. 2**5 in magnitude, so that blocks hold FP8 subnormals."""
    spread = torch.randint(-24, 6, shape, generator=generator).float().exp2()
    return (torch.randn(shape, generator=generator) * spread).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_matches_reference(dtype, world):
    """The fused kernel's bytes and scales are the torch reference's, on the GPU and the CPU;
    with source scales too. Control: the reference with the block transposed differs."""
    from megatron_hybrid.hf.fp8 import quantize_reference
    from megatron_hybrid.hf.fp8_stream import quantize

    _, _, device = world
    generator = torch.Generator().manual_seed(1)
    cases = [((300, 520), (128, 128)), ((257, 130), (16, 24)), ((4096, 512), (128, 128))]
    rows = []
    for shape, block in cases:
        w = _weights(generator, shape, dtype, device)
        w[: block[0], : block[1]] = 0  # an all-zero block
        for scale_dtype in (torch.float32, torch.bfloat16):
            q, s = quantize(w, block, scale_dtype=scale_dtype)
            q_ref, s_ref = quantize_reference(w, block, scale_dtype=scale_dtype)
            q_cpu, s_cpu = quantize_reference(w.cpu(), block, scale_dtype=scale_dtype)
            assert _same(q, q_ref) and _same(s, s_ref), (shape, block, scale_dtype)
            assert _same(q, q_cpu) and _same(s, s_cpu), (shape, block, scale_dtype)
            # Source scales: the dequantized weight keeps them and gives the same bytes back.
            values = (q.float() * s.repeat_interleave(block[0], 0)[: shape[0]]
                      .repeat_interleave(block[1], 1)[:, : shape[1]]).to(dtype)  # fmt: skip
            q2, s2 = quantize(values, block, s.to(scale_dtype), scale_dtype)
            assert _same(q2, q) and _same(s2, s), (shape, block, scale_dtype)
            if shape[0] != shape[1] and block[0] != block[1]:
                q_bug, _ = quantize_reference(w, block[::-1], scale_dtype=scale_dtype)
                assert not _same(q_bug, q)
            rows.append((shape, block, str(scale_dtype).split(".")[-1], "bitwise"))
    # Non-finite values: a NaN block gets a NaN scale, an infinite one an infinite scale (their
    # bytes 0), an underflowing scale is 1.
    w = _weights(generator, (32, 48), dtype, device)
    w[3, 4], w[20, 30], w[:16, 24:] = float("nan"), float("inf"), 0
    w[5, 30] = 1e-44 if dtype == torch.float32 else 0
    for scale_dtype in (torch.float32, torch.bfloat16):
        q, s = quantize(w, (16, 24), scale_dtype=scale_dtype)
        q_ref, s_ref = quantize_reference(w, (16, 24), scale_dtype=scale_dtype)
        assert s[0, 0].isnan() and s[1, 1].isinf() and s[0, 1] == 1, s
        assert _same(q, q_ref), scale_dtype  # bitwise: the faulty blocks hold (signed) zeros
        assert torch.equal(s.isnan(), s_ref.isnan()), scale_dtype
        assert torch.equal(s.nan_to_num(), s_ref.nan_to_num()), scale_dtype
        rows.append(((32, 48), (16, 24), str(scale_dtype).split(".")[-1], "non-finite"))
    report(f"FP8 kernel vs torch reference ({str(dtype).split('.')[-1]})", rows)


#: Layouts of the fixture folders: ``name -> (load_hf_model sizes, folders)``; PP2 splits the
#: four-layer DeepSeek-V3 (the three-layer folders' patterns cannot split evenly).
FP8_LAYOUTS = {
    "tp1": ({}, FP8_FIXTURES),
    "tp2": (dict(tensor_model_parallel_size=2), FP8_FIXTURES),
    "ep2": (dict(expert_model_parallel_size=2), FP8_FIXTURES),
    "pp2": (dict(pipeline_model_parallel_size=2), ("deepseek_v3_4l_fp8",)),
}


def _logits(model, ids, positions, device):
    """Full logits on every rank (a two-stage model's last stage sends them back)."""
    import torch.distributed as dist

    pg = model.pg_collection.pp
    if pg.size() == 1:
        return model(ids, positions, None).float()
    first, last = dist.get_global_rank(pg, 0), dist.get_global_rank(pg, 1)
    hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size, device=device)
    shape = torch.zeros(3, dtype=torch.long, device=device)
    if pg.rank() == 0:
        dist.send(model(ids, positions, None).contiguous(), dst=last, group=pg)
        dist.recv(shape, src=last, group=pg)
        logits = torch.empty(*shape.tolist(), device=device)
        dist.recv(logits, src=last, group=pg)
        return logits
    dist.recv(hidden, src=first, group=pg)
    model.set_input_tensor(hidden)
    logits = model(ids, positions, None).float().contiguous()
    dist.send(torch.tensor(logits.shape, device=device), dst=first, group=pg)
    dist.send(logits, dst=first, group=pg)
    return logits


def _flip_first_expert(model) -> str:
    """Negative control: this rank's first routed expert weight with its sign flipped (a scale
    applied with the wrong sign, or an expert's blocks read from another's)."""
    for name, param in model.named_parameters():
        if ".experts." in name and param.dim() >= 2:
            with torch.no_grad():
                param.neg_()
            return name
    return ""


@pytest.mark.parametrize("layout", list(FP8_LAYOUTS))
def test_fp8_folders_load_and_stream_back(world, hf_folders, layout):
    """The FP8 fixtures on the GPU at TP1, TP2, EP2 and PP2 (float32 parameters):
    transformers' logits on the dequantized weights, and the folder streamed back bitwise.
    Control: one expert weight with its sign flipped must leave the bound."""
    from megatron_hybrid.hf import iter_hf_weights, load_hf_model
    from megatron_hybrid.process_groups import reset_megatron_state

    rank, world_size, device = world
    sizes, names = FP8_LAYOUTS[layout]
    if world_size % max(sizes.values(), default=1):
        pytest.skip(f"{layout} needs an even number of GPUs; this job has {world_size}")
    rows = [("folder", "max abs logits diff", "bound", "control", "tensors", "not bitwise")]
    for name in names:
        folder = hf_folders / name
        reference = torch.load(folder / "reference.pt")
        reset_megatron_state()
        model = load_hf_model(
            folder,
            **sizes,
            params_dtype=torch.float32,
            # GatedDeltaNet's torch path (the CPU back-end sets it itself)
            config_overrides=None if ON_CPU else {"deterministic_mode": True},
        ).eval()
        ids = reference["input_ids"].to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        with exact_float32(), torch.no_grad():
            logits = _logits(model, ids, positions, device).cpu()
        diff = (logits - reference["logits"]).abs().max().item()
        disk = _read_folder(folder)
        streamed = dict(iter_hf_weights(model))
        wrong = [n for n in disk if n not in streamed or not _same(streamed[n], disk[n])]
        flipped = _flip_first_expert(model)
        with exact_float32(), torch.no_grad():
            control = (_logits(model, ids, positions, device).cpu() - reference["logits"]).abs()
        control = control.max().item()
        where = flipped or "no expert here"
        rows.append((name, f"{diff:.2e}", f"{reference['bound']:.2e}",
                     f"{control:.2e} ({where})", len(disk), len(wrong)))  # fmt: skip
        assert diff <= reference["bound"], (name, diff)
        assert disk and wrong == [] and set(streamed) == set(disk), (name, wrong[:5])
        assert control > 10 * reference["bound"], (name, "control within the bound", control)
    report(f"FP8 fixture folders at {layout}, {world_size} ranks", rows)
    reset_megatron_state()


@pytest.mark.time_limit(240)
def test_gpu_sized_model_through_fp8(world, shared_dir):
    """A 0.86 B-parameter bf16 model written as FP8 by the recipe (fused kernel), its bytes the
    torch reference's; loaded from that folder (experts over all GPUs), dequantized exactly
    into bf16, and streamed back bitwise."""
    import torch.distributed as dist

    from megatron_hybrid.hf import iter_hf_weights, load_hf_model, save_hf_checkpoint
    from megatron_hybrid.hf.api import build_model
    from megatron_hybrid.hf.config import hf_config_to_megatron
    from megatron_hybrid.hf.fp8 import SCALE_SUFFIX, dequantize, quantize_reference
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    rank, world_size, device = world
    sizes = CPU_SIZED if ON_CPU else GPU_SIZED
    config = dict(
        model_type="qwen3_5_moe_text", dtype="bfloat16", rms_norm_eps=1e-6, hidden_act="silu",
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        **sizes,
    )  # fmt: skip
    if sizes["num_experts"] % world_size:
        pytest.skip(f"{sizes['num_experts']} experts do not spread over {world_size} GPUs")
    reset_megatron_state()
    conversion = hf_config_to_megatron(config)
    pg = initialize_model_parallel(ep=world_size)
    model = build_model(conversion, pg, perform_initialization=False).eval()
    generator = torch.Generator(device=device).manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    params = sum(p.numel() for p in model.parameters())
    total = torch.tensor([params], device=device)
    dist.all_reduce(total)
    folder = Path(shared_dir) / "gpu_sized_fp8"
    began = time.perf_counter()
    save_hf_checkpoint(model, folder, quantize="fp8", conversion=conversion, max_shard_size="2GB")
    dist.barrier()
    saved = time.perf_counter() - began
    disk = _read_folder(folder) if rank == 0 else {}
    # The recipe's bytes: the kernel's output against the torch reference of the same weights.
    mismatched = []
    for name, tensor in iter_hf_weights(model, quantize="none", conversion=conversion):
        if rank == 0 and name + SCALE_SUFFIX in disk:
            q, s = quantize_reference(tensor, (128, 128))
            if not (_same(q, disk[name]) and _same(s, disk[name + SCALE_SUFFIX])):
                mismatched.append(name)
    del model
    reset_megatron_state()
    began = time.perf_counter()
    loaded = load_hf_model(folder, expert_model_parallel_size=world_size).eval()
    load_seconds = time.perf_counter() - began
    wrong, values_wrong = [], []
    for name, tensor in iter_hf_weights(loaded, quantize="none"):
        if rank == 0 and name + SCALE_SUFFIX in disk:
            # On the GPU: torchrun gives each rank one CPU thread.
            q, s = disk[name].to(tensor.device), disk[name + SCALE_SUFFIX].to(tensor.device)
            if not _same(tensor, dequantize(q, s, (128, 128)).to(torch.bfloat16)):
                values_wrong.append(name)
    streamed = {}
    for name, tensor in iter_hf_weights(loaded):
        if rank == 0:
            streamed[name] = name in disk and _same(tensor, disk[name])
    wrong = sorted(n for n, ok in streamed.items() if not ok) + sorted(set(disk) - set(streamed))
    report(
        "GPU-sized Qwen3.5-MoE through FP8",
        [("parameters", f"{total.item() / 1e9:.2f} B"), ("GPUs (EP)", world_size),
         ("FP8 weights", sum(1 for n in disk if n.endswith(SCALE_SUFFIX))),
         ("save s", f"{saved:.1f}"), ("load s", f"{load_seconds:.1f}"),
         ("kernel bytes != reference", len(mismatched)),
         ("loaded values != q * s", len(values_wrong)), ("streamed back not bitwise", len(wrong))],
    )  # fmt: skip
    reset_megatron_state()
    assert mismatched == [] and values_wrong == [] and wrong == []

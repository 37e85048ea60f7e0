"""HybridEP (DeepEP's hybrid-ep branch) through megatron-core's flex dispatcher, on batches padded
by ``megatron_hybrid.padding``, against the ``alltoall`` dispatcher (1, 2 and 4 GPUs, NCCL).

    torchrun --nproc_per_node 4 -m pytest -q -s tests/functional/test_hybridep_gpu.py
    pytest -q -s -m launcher tests/functional/test_hybridep_gpu.py     # the `train` command

Needs ``deep_ep`` with ``HybridEPBuffer`` and ``CUDA_HOME`` (HybridEP compiles its kernels at
first use with ``$CUDA_HOME/bin/nvcc``, about 5-10 s per kernel and 5 kernels per process); every
test skips with the reason otherwise (``capabilities.flex_backend_unavailable``), and also
where DeepEP cannot make its buffer at all (``hybridep_probe.py`` asks a job of its own first:
the constructor has crashed with SIGSEGV on H100 and H200, taking the test process with it).
Buffers are made with DeepEP's ``load_cached_kernels`` so each process compiles once: every case
keeps the kernels' template (hidden 128, EP = the world, 4 experts, at most 512 tokens per rank).

**Bounds.** HybridEP moves only bf16 tokens (its combine asserts 2-byte elements), so both
dispatchers run in bf16 and the yardstick is the ``alltoall`` model's own bf16 error: the same
model and batch in float32 (TF32 off). Two bf16 runs that differ only in the order of the
expert rows and of the top-k sum are each about that far from float32, so by the triangle
inequality they differ by at most about twice it; the bound is 3x it, never below 2^-8 (one
bf16 rounding of every element, norm-relative). Under context parallelism TransformerEngine has
no float32 attention (its fused and flash attention take bf16/fp16, its unfused one no CP), so
the CP2 case's yardstick is another order of the same sums: the ``allgather`` dispatcher's bf16
run against ``alltoall``'s (the same model, attention and batch; only the expert rows and the
top-k sum in another order, as between hybridep and alltoall). Compared: the per-token losses
and every parameter gradient, norm-relative. Patterns hold one MoE layer: before it both runs are
bitwise the same, so no top-k choice can flip between them. A deliberate bug (the dispatched
probabilities squared, as if applied twice) must break the bound.

**Negative controls** (the same sequences without our padding): each rank's rows padded only to
its own longest row give each rank of the TP x EP group another token count. DeepEP then
all-gathers routing maps of different lengths (``Executor::allgather_routing_map``): wrong
routing or a hang upstream (DeepEP #604); here the groups are built with torch's collective
checker on (``TORCH_DISTRIBUTED_DEBUG=DETAIL``), which raises on every rank instead. Equal but
unaligned counts are accepted since DeepEP 4214430 pads its buffers to the chunk, except where
HybridEP's TMA check refuses them: two ranks per NVLink domain and an odd count modulo 64
(``TMA 16B alignment error``, DeepEP #561's hang turned into an error). The test says which
happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import NUM_EXPERTS, Job, exact_float32, launch_all, report

HIDDEN, HEADS, FFN, VOCAB = 128, 8, 256, 128
BF16_ROUNDING = 2.0**-8  # norm-relative floor: one bf16 rounding of every element
MARGIN = 3.0  # x the alltoall run's own bf16-vs-float32 difference (see the module docstring)
MODEL_KEYS = ("input_ids", "position_ids", "attention_mask", "labels", "packed_seq_params",
              "padding_mask")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    pattern: str
    layout: str = "bshd"  # or "thd" (packed)
    tp: int = 1
    quant: str | None = None  # planner multiple only; the run stays bf16
    batch: int = 2
    max_len: int = 120

    @property
    def id(self) -> str:
        quant = f"-{self.quant}-multiple" if self.quant else ""
        return f"{self.pattern}-{self.layout}-tp{self.tp}{'-sp' if self.tp > 1 else ''}{quant}"


CASES = [
    Case("[*E]"),
    Case("[*E]", layout="thd", batch=3),
    Case("[*E]", tp=2, max_len=240),
    Case("[*E]", layout="thd", tp=2, batch=3),
    Case("[*E]", quant="mxfp8"),
    Case("[GE]"),  # megatron's torch GatedDeltaNet path (deterministic mode; no THD there)
    Case("[ME]"),  # the package's torch Mamba2 path unless mamba_ssm is installed
]


def _unavailable() -> str | None:
    from megatron_hybrid.training.capabilities import flex_backend_unavailable

    problem = flex_backend_unavailable("hybridep")
    return f"HybridEP {problem}" if problem else None


@functools.cache
def _buffer_crashes(ranks: int) -> str | None:
    """What ends a job that only makes DeepEP's buffer on ``ranks`` GPUs (None: it is made), from
    ``hybridep_probe.py`` in a torchrun job of its own (about 15 s)."""
    import suite_guard
    from conftest import _TORCHRUN_VARIABLES

    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybridep_probe.py")
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--standalone", probe, str(HIDDEN), "512",
               str(NUM_EXPERTS)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    suite_guard.track_child(proc)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        suite_guard.kill_tree(proc.pid)
        return f"making DeepEP's HybridEPBuffer on {ranks} GPU(s) did not end within 180 s"
    finally:
        suite_guard.untrack_child(proc)
    if proc.returncode == 0:
        return None
    signals = re.findall(r"Signal (\d+) \((SIG[A-Z]+)\)", output)
    how = f"{signals[0][1]}" if signals else f"exit code {proc.returncode}"
    return (
        f"DeepEP's HybridEPBuffer constructor dies ({how}) on {ranks} GPU(s) of this machine, "
        "outside any test (tests/functional/hybridep_probe.py; issue 37)"
    )


def _require_buffer(world_size: int) -> None:
    """Skip, on every rank alike, where DeepEP cannot make its buffer (rank 0 asks the probe)."""
    verdict = [_buffer_crashes(world_size) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        pytest.skip(verdict[0])


@pytest.fixture
def hybridep(world):
    """Skip without HybridEP, or where its buffer cannot be made; a fresh HybridEP buffer per
    test that reuses compiled kernels."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    _require_buffer(world[1])
    from megatron.core.transformer.moe import fused_a2a

    made = fused_a2a.HybridEPBuffer
    # The kernel cache lives in the buffer; with this flag a new buffer loads what this process
    # compiled before (DeepEP keeps them per process under ~/.deepep/hybrid_ep/jit/proc-<pid>).
    fused_a2a.HybridEPBuffer = functools.partial(made, load_cached_kernels=True)
    fused_a2a.reset_hybrid_ep_buffer()
    try:
        yield world
    finally:
        torch.cuda.synchronize()
        fused_a2a.reset_hybrid_ep_buffer()
        fused_a2a.HybridEPBuffer = made


def _require_group(world_size: int) -> None:
    if world_size < 2 or NUM_EXPERTS % world_size:
        pytest.skip(
            f"HybridEP dispatches over a TP x EP group of >= 2 ranks (EP = world size dividing "
            f"the {NUM_EXPERTS} experts); this job has {world_size} rank(s): run on 2 or 4 GPUs"
        )


def _agree(failures: list[str]) -> None:
    """Fail on every rank when any rank failed (a lone failing rank would hang the others)."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, failures)
    everyone = [f"rank {r}: {f}" for r, fs in enumerate(gathered) for f in fs]
    assert not everyone, "\n".join(everyone)


# ----------------------------------------------------------------------------------- plumbing


def _config(case: Case, world_size: int, dispatcher: str, *, bf16: bool = True, **changes):
    from megatron_hybrid.testing.models import small_config

    flex = dispatcher == "hybridep"
    kwargs = dict(
        hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=case.tp, sequence_parallel=case.tp > 1,
        expert_model_parallel_size=world_size, expert_tensor_parallel_size=1,
        moe_router_dtype="fp32",  # HybridEP takes float32 probabilities; alltoall gets the same
        moe_token_dispatcher_type="flex" if flex else "alltoall",
    )  # fmt: skip
    if flex:
        kwargs["moe_flex_dispatcher_backend"] = "hybridep"
    if bf16:
        kwargs.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    return small_config(case.pattern, **(kwargs | changes))


def _model(config, pattern: str, pg, device, state=None):
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import build_hybrid

    torch.manual_seed(1)
    model = build_hybrid(config, pattern, pg, vocab_size=VOCAB, max_sequence_length=512)
    model = model.to(device)
    if config.bf16:
        model = Float16Module(config, model)
    if state is not None:
        target = model.module if config.bf16 else model
        target.load_state_dict(state)
    return model


def _sequences(case: Case, pg, *, lengths=None):
    """This data-parallel rank's sequences (TP ranks share them; EP ranks do not)."""
    generator = torch.Generator().manual_seed(100 + pg.dp.rank())
    if lengths is None:
        low = case.max_len // 3
        lengths = torch.randint(low, case.max_len + 1, (case.batch,), generator=generator)
    return [torch.randint(1, VOCAB, (int(n) + 1,), generator=generator) for n in lengths]


def _batch(case: Case, config, pg, device, sequences, *, ours: bool = True) -> dict:
    """The sequences as one micro-batch: padded (BSHD) or packed (THD) by our planners and made
    equal across the TP x EP group (``ours``), or padded only to this rank's longest row."""
    from megatron_hybrid.data.batches import build_micro_batch
    from megatron_hybrid.data.samples import TokenSample
    from megatron_hybrid.padding import padding_config_from

    padding = padding_config_from(config, pg)
    if not ours:  # no alignment term at all, no equal counts
        padding = dataclasses.replace(padding, tp=1, sp=False, quant=None, hybridep=False)
    elif case.quant:
        padding = dataclasses.replace(padding, quant=case.quant)

    packed = case.layout == "thd"
    fixed = None
    if padding.fixed_length_required:  # as train: rows of the sequence length, or its multiple
        fixed = case.max_len * len(sequences) if packed else case.max_len
    batch = build_micro_batch(
        [TokenSample(s) for s in sequences], padding, packed=packed, fixed_length=fixed,
        equalize_group=pg.tp_ep if ours else None,
    )  # fmt: skip
    return batch.to(device).step_inputs()


def _run(model, batch) -> tuple[torch.Tensor, dict]:
    """Per-token losses of the real tokens and every parameter gradient (float32 copies)."""
    model.zero_grad(set_to_none=True)
    losses = model(**{k: batch.get(k) for k in MODEL_KEYS}).float()
    mask = batch["loss_mask"].float()
    ((losses * mask).sum() / mask.sum()).backward()
    grads = {
        name.removeprefix("module."): None if p.grad is None else p.grad.detach().float().clone()
        for name, p in model.named_parameters()
    }
    return losses.detach()[mask.bool()], grads


def _rel(actual, reference) -> float:
    from megatron_hybrid.testing.overlap import rel_error

    if reference is None or actual is None:
        return 0.0 if reference is None and actual is None else math.inf
    return rel_error(actual, reference)


def _compare(run, bf16, fp32) -> dict[str, tuple[float, float]]:
    """``{name: (difference to the bf16 alltoall run, bound)}`` for the losses and each grad."""
    out = {}
    pairs = [("per-token loss", run[0], bf16[0], fp32[0])]
    pairs += [(n, run[1][n], bf16[1][n], fp32[1][n]) for n in bf16[1]]
    for name, actual, reference, truth in pairs:
        yardstick = _rel(reference, truth)
        out[name] = (_rel(actual, reference), max(MARGIN * yardstick, BF16_ROUNDING))
    return out


def _worst(comparison: dict) -> tuple[str, float, float]:
    """The entry closest to (or furthest past) its bound."""
    name = max(comparison, key=lambda n: comparison[n][0] / comparison[n][1])
    return name, *comparison[name]


@contextlib.contextmanager
def _probs_applied_twice():
    """The deliberate bug: the experts get each dispatched probability squared."""
    from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

    original = _HybridEPManager.get_permuted_hidden_states_by_experts

    def squared(self, hidden_states):
        hidden, probs = original(self, hidden_states)
        return hidden, probs * probs

    _HybridEPManager.get_permuted_hidden_states_by_experts = squared
    try:
        yield
    finally:
        _HybridEPManager.get_permuted_hidden_states_by_experts = original


# -------------------------------------------------------------------------------------- tests


def test_dispatch_combine_roundtrip(hybridep):
    """megatron-core's HybridEP autograd functions on the whole world: every token reaches
    exactly its top-2 experts and comes back, forward and backward, bit for bit; the dispatched
    probabilities are the routed ones. Times the first call (kernel compilation)."""
    from megatron.core.transformer.moe import fused_a2a

    rank, world_size, device = hybridep
    if NUM_EXPERTS % world_size:
        pytest.skip(f"{NUM_EXPERTS} experts do not divide over {world_size} ranks")
    group, local = torch.distributed.group.WORLD, NUM_EXPERTS // world_size
    tokens = 200  # not a multiple of the 64-token chunk: the last chunk is partial
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(device, torch.bfloat16)
    scores = torch.rand(tokens, NUM_EXPERTS, generator=generator).to(device)
    top = scores.topk(2, dim=1).indices
    routing = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    probs = (scores.softmax(dim=1) * routing).contiguous()
    rows, timings = [], []
    for weighted in (False, True, False):
        leaf_x, leaf_p = x.clone().requires_grad_(), probs.clone().requires_grad_()
        torch.cuda.synchronize()
        began = time.perf_counter()
        out, out_probs, _, per_expert, handle = fused_a2a.hybrid_ep_dispatch(
            leaf_x, routing, leaf_p, group, local
        )
        expert_out = out * out_probs.unsqueeze(1).to(out.dtype) if weighted else out
        y = fused_a2a.hybrid_ep_combine(expert_out, handle, per_expert.sum(), None)
        grad = torch.ones_like(y)
        y.backward(grad)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - began)
        rows.append((weighted, y, leaf_x.grad, leaf_p.grad, per_expert, out_probs))
    failures = []
    _, y, gx, _, per_expert, out_probs = rows[0]
    if not torch.equal(y, 2 * x) or not torch.equal(gx, 2 * torch.ones_like(x)):
        failures.append("combine(dispatch(x)) != 2x or its gradient != 2 (top-2 identity)")
    everyone = [torch.empty_like(routing) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, routing)
    expected = torch.cat(everyone).sum(0)[rank * local : (rank + 1) * local]
    if per_expert.tolist() != expected.tolist():
        failures.append(f"tokens per local expert {per_expert.tolist()} != {expected.tolist()}")
    sums = torch.stack([out_probs.double().sum(), probs.double().sum()])
    torch.distributed.all_reduce(sums)
    if not torch.isclose(sums[0], sums[1], rtol=1e-6):
        failures.append(f"dispatched probabilities sum to {sums[0]:.6f}, routed {sums[1]:.6f}")
    _, yw, gxw, gpw, _, _ = rows[1]
    # y_t = (p_t1 + p_t2) x_t; dL/dp_te = <x_t, 1> where routed (bf16 products: 2^-8 relative)
    ref_y = probs.sum(1, keepdim=True) * x.float()
    ref_gp = routing * x.float().sum(1, keepdim=True)
    for what, got, ref in (("weighted combine", yw, ref_y), ("probability gradient", gpw, ref_gp)):
        err = _rel(got.float(), ref)
        if err > 2 * BF16_ROUNDING:
            failures.append(f"{what}: relative error {err:.2e} > {2 * BF16_ROUNDING:.2e}")
    report(
        f"HybridEP dispatch/combine round trip, {world_size} rank(s), {tokens} tokens per rank",
        [("call", "seconds"), ("first (compiles the kernels)", f"{timings[0]:.1f}"),
         ("weighted by the dispatched probabilities", f"{timings[1]:.3f}"),
         ("unweighted again", f"{timings[2]:.4f}")],
    )  # fmt: skip
    _agree(failures)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hybridep_matches_alltoall(hybridep, case: Case):
    """Loss and gradients of the flex/hybridep model equal the alltoall model's on the same
    padded batch (bound: see the module docstring); the deliberate bug breaks the bound."""
    from megatron_hybrid.process_groups import initialize_model_parallel

    rank, world_size, device = hybridep
    _require_group(world_size)
    if world_size % case.tp:
        pytest.skip(f"TP{case.tp} does not divide {world_size} ranks")
    pg = initialize_model_parallel(tp=case.tp, ep=world_size, etp=1, seed=3)
    configs = {d: _config(case, world_size, d) for d in ("alltoall", "hybridep")}
    batch = _batch(case, configs["hybridep"], pg, device, _sequences(case, pg))
    tokens = batch["input_ids"].numel() // (case.tp if case.tp > 1 else 1)
    alltoall = _model(configs["alltoall"], case.pattern, pg, device)
    state = alltoall.module.state_dict()
    flex = _model(configs["hybridep"], case.pattern, pg, device, state)
    fp32 = _model(_config(case, world_size, "alltoall", bf16=False), case.pattern, pg, device,
                  state)  # fmt: skip
    bf16_run, run = _run(alltoall, batch), _run(flex, batch)
    with exact_float32():
        fp32_run = _run(fp32, batch)
    with _probs_applied_twice():
        buggy = _run(flex, batch)
    ok, bug = _compare(run, bf16_run, fp32_run), _compare(buggy, bf16_run, fp32_run)
    name, diff, bound = _worst(ok)
    bug_name, bug_diff, bug_bound = _worst(bug)
    report(
        f"{case.id}: hybridep vs alltoall, {world_size} GPUs (rank 0)",
        [("tokens per rank (dispatched)", tokens),
         ("real tokens", batch["num_tokens"]),
         ("hybridep, worst", f"{name}: {diff:.2e} <= {bound:.2e}"),
         ("probs applied twice, worst", f"{bug_name}: {bug_diff:.2e} > {bug_bound:.2e}")],
    )  # fmt: skip
    failures = [f"{n}: {d:.3e} > bound {b:.3e}" for n, (d, b) in ok.items() if d > b]
    if bug_diff <= bug_bound:
        failures.append(f"the deliberate bug stays within the bound ({bug_diff:.2e})")
    counts = [None] * world_size
    torch.distributed.all_gather_object(counts, tokens)
    if len(set(counts)) != 1:
        failures.append(f"tokens per rank differ across the group: {counts}")
    _agree(failures)


def _checked_groups(world_size: int):
    """Model-parallel groups built with torch's collective checker (None if it is unavailable)."""
    import torch.distributed as dist

    from megatron_hybrid.process_groups import initialize_model_parallel

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        pg = initialize_model_parallel(tp=1, ep=world_size, etp=1, seed=3)
    finally:
        dist.set_debug_level(level)
    backend = pg.tp_ep._get_backend(torch.device("cuda"))
    return pg if "Wrapper" in type(backend).__name__ else None


def test_without_our_padding(hybridep):
    """The same kind of sequences without our padding: unequal counts fail on every rank
    (here: torch's collective checker at HybridEP's routing-map all-gather); equal unaligned
    counts fail HybridEP's TMA check on 2 ranks and match alltoall on 4. Reports which."""
    rank, world_size, device = hybridep
    _require_group(world_size)
    pg = _checked_groups(world_size)
    if pg is None:
        pytest.skip("torch's collective checker (TORCH_DISTRIBUTED_DEBUG=DETAIL) did not wrap "
                    "the groups: without it unequal counts would hang NCCL")  # fmt: skip
    rows, failures = [("batch", "tokens per rank", "outcome")], []
    case = Case("[*E]")
    config = _config(case, world_size, "hybridep")
    alltoall = _model(_config(case, world_size, "alltoall"), case.pattern, pg, device)
    flex = _model(config, case.pattern, pg, device, alltoall.module.state_dict())
    # Unequal: rank r's longest row is 90 + 7r tokens (B = 2), THD packs 3 sequences.
    unequal = [
        (Case("[*E]"), [60, 90 + 7 * pg.dp.rank()]),
        (Case("[*E]", layout="thd", batch=3), [40, 51, 70 + 5 * pg.dp.rank()]),
    ]
    for each, lengths in unequal:
        batch = _batch(each, config, pg, device, _sequences(each, pg, lengths=lengths),
                       ours=False)  # fmt: skip
        try:
            _run(flex, batch)
            outcome = "ran"
        except RuntimeError as err:
            outcome = str(err)
        shown = "collective mismatch" if "mismatch between collectives" in outcome else outcome
        rows.append((f"{each.layout} unequal", batch["input_ids"].numel(), shown[:80]))
        if not re.search(r"mismatch between collectives", outcome):
            failures.append(f"{each.layout}, unequal counts: expected the all-gather mismatch, "
                            f"got {outcome[:300]!r}")  # fmt: skip
    # Equal and unaligned: every rank one row of 101 tokens (101 % 64 = 37, odd).
    same = _sequences(case, pg, lengths=[101])
    batch = _batch(Case("[*E]", batch=1), config, pg, device, same, ours=False)
    try:
        run = _run(flex, batch)
        outcome = "ran"
    except RuntimeError as err:
        run, outcome = None, str(err)
    if world_size == 2:  # (37 * 2 ranks * 4 bytes) % 16 != 0
        expected = "TMA 16B alignment error" in outcome
    else:  # 4 ranks: 37 * 4 * 4 bytes is 16-byte aligned
        fp32 = _model(_config(case, world_size, "alltoall", bf16=False), case.pattern, pg,
                      device, alltoall.module.state_dict())  # fmt: skip
        with exact_float32():
            truth = _run(fp32, batch)
        bounds = _compare(run, _run(alltoall, batch), truth) if run is not None else {}
        expected = bool(bounds) and all(d <= b for d, b in bounds.values())
        outcome = "ran, equal to alltoall" if expected else outcome
    rows.append(("bshd equal, 101 tokens", 101, outcome[:80]))
    if not expected:
        failures.append(f"equal unaligned counts on {world_size} ranks: got {outcome[:300]!r}")
    report(f"without our padding, {world_size} GPUs (rank 0)", rows)
    _agree(failures)


def test_ep_overlap_with_hybridep(hybridep):
    """combined-1F1B (``overlap_moe_expert_parallel_comm``, which megatron-core 0.19.2 allows
    with the flex dispatcher) on the hybridep backend: the losses and gradients of its plain
    schedule, within twice alltoall's own overlap-vs-plain difference or one bf16 rounding."""
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid
    from megatron_hybrid.testing.overlap import compare_overlap

    rank, world_size, device = hybridep
    _require_group(world_size)
    pattern, case = "[*E]{2}", Case("[*E]{2}")
    pg = initialize_model_parallel(ep=world_size, etp=1, seed=5)

    def build(run_config):
        torch.manual_seed(3)
        model = build_hybrid(run_config, pattern, pg, vocab_size=VOCAB, max_sequence_length=512)
        return [Float16Module(run_config, model.to(device))]

    rows, worst = [("dispatcher", "max rel diff overlap vs plain (losses, grads)")], {}
    for dispatcher in ("alltoall", "hybridep"):
        # 4 micro-batches of 2 x 128 tokens: 256 per rank, a multiple of the chunk everywhere.
        out = compare_overlap(build, _config(case, world_size, dispatcher), steps=1,
                              num_microbatches=4, micro_batch_size=2, seq_length=128,
                              vocab=VOCAB)  # fmt: skip
        plain, overlap = out["plain"], out["overlap"]
        diffs = [abs(a - b) / abs(b) for a, b in zip(overlap["losses"], plain["losses"],
                                                     strict=True)]  # fmt: skip
        diffs += [_rel(overlap["grads"][0][n], g) for n, g in plain["grads"][0].items()]
        worst[dispatcher] = max(diffs)
        rows.append((dispatcher, f"{worst[dispatcher]:.2e}"))
    bound = max(2 * worst["alltoall"], BF16_ROUNDING)
    report(f"EP={world_size} overlap vs plain, bound {bound:.2e}", rows)
    _agree(
        []
        if worst["hybridep"] <= bound
        else [f"hybridep overlap differs from plain by {worst['hybridep']:.2e} > {bound:.2e}"]
    )


@pytest.mark.parametrize("what", ["cp2", "fp8"])
def test_te_context_parallel_and_fp8(hybridep, what):
    """With TransformerEngine: CP2 (TE's attention; each rank a zig-zag half of the rows) and
    FP8 GEMMs (HybridEP pads each expert's rows to 16, megatron's alltoall pads the routing
    map); hybridep against alltoall, bounded by alltoall's own distance to float32 (FP8) or to
    the allgather dispatcher's bf16 run (CP2: see the module doc)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pytest.skip(f"{what} needs TransformerEngine (the 'te' backend): not installed")
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_hybrid.process_groups import initialize_model_parallel

    rank, world_size, device = hybridep
    _require_group(world_size)
    cp = 2 if what == "cp2" else 1
    if world_size % cp:
        pytest.skip(f"CP{cp} does not divide {world_size} ranks")
    if what == "fp8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 GEMMs need a Hopper or newer GPU")
    case = Case("[*E]", quant="delayed" if what == "fp8" else None, max_len=200)
    pg = initialize_model_parallel(ep=world_size, etp=1, cp=cp, seed=3)
    extra = dict(context_parallel_size=cp, cp_comm_type="p2p") if cp > 1 else {}
    if what == "fp8":
        extra = dict(fp8="hybrid", fp8_recipe="delayed", moe_router_padding_for_quantization=True)
    configs = {d: _config(case, world_size, d, **extra) for d in ("alltoall", "hybridep")}
    batch = _batch(case, configs["hybridep"], pg, device, _sequences(case, pg))
    if cp > 1:  # TE's CP attention takes this rank's two zig-zag chunks of every row
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
        batch |= get_batch_on_this_cp_rank(tensors, is_hybrid_cp=False, cp_group=pg.cp)

    def model(config, state=None):
        from megatron.core.transformer.module import Float16Module

        from megatron_hybrid.testing.models import build_hybrid

        torch.manual_seed(1)
        built = build_hybrid(config, case.pattern, pg, backend="te", vocab_size=VOCAB,
                             max_sequence_length=512).to(device)  # fmt: skip
        built = Float16Module(config, built) if config.bf16 else built
        if state is not None:
            (built.module if config.bf16 else built).load_state_dict(state, strict=False)
        return built

    alltoall = model(configs["alltoall"])
    state = alltoall.module.state_dict()
    runs = {"alltoall": _run(alltoall, batch),
            "hybridep": _run(model(configs["hybridep"], state), batch)}  # fmt: skip
    if cp > 1:  # no float32 CP attention in TE: another order of the same bf16 sums (doc above)
        allgather = _config(case, world_size, "alltoall", **extra,
                            moe_token_dispatcher_type="allgather")  # fmt: skip
        truth = _run(model(allgather, state), batch)
    else:
        fp32_config = _config(
            case,
            world_size,
            "alltoall",
            bf16=False,
            **{k: v for k, v in extra.items() if not k.startswith(("fp8", "moe_"))},
        )
        with exact_float32():
            truth = _run(model(fp32_config, state), batch)
    comparison = _compare(runs["hybridep"], runs["alltoall"], truth)
    name, diff, bound = _worst(comparison)
    report(f"TE {what}: hybridep vs alltoall, {world_size} GPUs (rank 0)",
           [("worst", f"{name}: {diff:.2e} <= {bound:.2e}")])  # fmt: skip
    _agree([f"{n}: {d:.3e} > {b:.3e}" for n, (d, b) in comparison.items() if d > b])


# --------------------------------------------------------------------- the train command

TRAIN = [
    "train", "--hybrid-layer-pattern", "[*E]", "--hidden-size", "128", "--num-attention-heads",
    "8", "--ffn-hidden-size", "256", "--num-experts", "4", "--moe-router-topk", "2",
    "--disable-bias-linear", "--transformer-impl", "local", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "2", "--seed", "1234",
    "--train-iters", "3", "--lr", "1e-3",
]  # fmt: skip


def _train_job(*extra: str, name: str) -> Job:
    gpus = torch.cuda.device_count()
    args = ["-m", "megatron_hybrid", *TRAIN,
            "--expert-model-parallel-size", str(math.gcd(gpus, NUM_EXPERTS)),
            "--global-batch-size", str(2 * gpus), *extra]  # fmt: skip
    return Job(args, gpus, name=name)


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", output)]


@pytest.mark.launcher
@pytest.mark.time_limit(200)  # three torchrun jobs side by side, beside the suite's other lanes
def test_train_command_hybridep():
    """``train --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep`` under
    torchrun (variable-length rows padded and made equal across the group by the data builder):
    its first loss equals alltoall's within 3x alltoall's own bf16-vs-float32 difference (never
    below 2^-12, a quarter of the printed digits' worth at this loss), and it trains."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    if torch.cuda.device_count() < 2:
        pytest.skip("HybridEP needs a TP x EP group of >= 2 GPUs")
    crash = _buffer_crashes(torch.cuda.device_count())
    if crash:
        pytest.skip(crash)
    jobs = [
        _train_job("--bf16", name="train alltoall bf16"),
        _train_job(name="train alltoall float32"),
        _train_job(
            "--bf16",
            "--moe-token-dispatcher-type",
            "flex",
            "--moe-flex-dispatcher-backend",
            "hybridep",
            name="train hybridep bf16",
        ),
    ]
    # Small models: the three jobs share the GPUs and start at once (one after another they took
    # more than 120 s on 2 x H200 beside the suite's other lanes).
    alltoall, fp32, flex = map(_losses, launch_all(jobs, timeout=180, share_gpus=True))
    print("\ntrain losses: alltoall bf16", alltoall, "| float32", fp32, "| hybridep bf16", flex)
    assert len(alltoall) == len(fp32) == len(flex) == 3
    bound = max(MARGIN * abs(alltoall[0] - fp32[0]) / fp32[0], 2.0**-12)
    assert abs(flex[0] - alltoall[0]) / alltoall[0] <= bound, (flex, alltoall, bound)
    assert all(math.isfinite(x) for x in flex)

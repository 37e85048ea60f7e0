"""megatron's fused cross entropy as two Triton passes (``kernels/cross_entropy.py``) under
Triton's CPU interpreter, on one and two gloo ranks (the vocabulary split over TP), against the
loss and gradient computed in float64, against megatron-core's own (unfused) vocab-parallel
cross entropy, and inside ``HybridModel``'s loss.

CUDA takes the kernels wherever Triton imports; on a CPU ``TRITON_INTERPRET=1`` routes host
tensors to them, and the ranks count the launches, so that no comparison can pass on a torch path.

Bounds: ``tests/support/cross_entropy.py`` (float32 error analysis of the kernels' order of
operations), with the interpreter's rounding to bf16: it truncates (a whole unit in the last
place, ``2^-7``; compiled Triton rounds to nearest, which ``tests/functional/
test_cross_entropy_gpu.py`` holds it to).

Rows mix random logits, rows that grow along the vocabulary (every block of the statistics pass
raises its running maximum) and targets at the first and last column, in another rank's shard
and outside the vocabulary (an ignored ``-100``: megatron's loss is then ``log S`` and no column
loses one). Negative controls: a target one column off, and TP shards whose statistics are not
combined, each exceed the bounds by far; a column left out of ``S`` where it weighs 6e-5 of the
row (in the flat row 4) exceeds the loss bound, which the generic bound would let pass.
"""

from __future__ import annotations

import io

import pytest
import torch
from support.cross_entropy import NEAREST, exact_cross_entropy

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROWS, VOCAB = 7, 9216  # two ranks' shards of 4,608 columns: over one 4,096-column block each
MODEL_VOCAB = 256
# The interpreter truncates float32 to bf16; float32 and float16 go through numpy (to nearest).
ROUNDING = {**NEAREST, torch.bfloat16: 2.0**-7}


def _exact(logits, target, grad, world: int):
    return exact_cross_entropy(logits, target, grad, world, ROUNDING[logits.dtype])


def _inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(11)
    logits = 4 * torch.randn(ROWS, VOCAB, generator=gen)
    logits[4] = torch.linspace(-1, 2, VOCAB)
    logits[5] = torch.linspace(-5, 40, VOCAB) + torch.randn(VOCAB, generator=gen)
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[0], target[5], target[6] = 0, VOCAB - 1, -100
    grad = torch.rand(ROWS, generator=gen) + 0.5
    return logits.to(dtype), target, grad


def _rank(rank: int, world: int, dtype_name: str) -> dict:
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from support.triton_interpreter import counting_ranges

    from megatron_hybrid.kernels.cross_entropy import vocab_parallel_cross_entropy
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    launches: list[str] = []
    counting_ranges(launches.append)
    dtype = getattr(torch, dtype_name)
    logits, target, grad = _inputs(dtype)
    group = dist.new_group(list(range(world)))
    shard = logits.chunk(world, -1)[rank].contiguous()

    def run(fn, *args, **kwargs):
        leaf = shard.clone().requires_grad_()
        loss = fn(leaf, *args, **kwargs)
        loss.backward(grad)
        return loss.detach(), leaf.grad

    out = {}
    out["loss"], out["grad"] = run(vocab_parallel_cross_entropy, target, group)
    out["launches"] = list(launches)
    out["megatron_loss"], out["megatron_grad"] = run(
        tensor_parallel.vocab_parallel_cross_entropy, target, tp_group=group
    )
    # Negative controls: the target one column to the right; every rank on its own shard.
    out["shifted_grad"] = run(vocab_parallel_cross_entropy, (target + 1) % VOCAB, group)[1]
    if world > 1:
        out["alone_loss"] = run(vocab_parallel_cross_entropy, target, None)[0]
    if rank == 0:  # column 4,095 of the flat row 4 is rank 0's at TP 1 and 2
        shard[4, 4095] = -float("inf")
    out["dropped_loss"] = run(vocab_parallel_cross_entropy, target, group)[0]
    # Plain lists: tensors would travel as shared memory of a process that has ended.
    return {k: v.float().tolist() if torch.is_tensor(v) else v for k, v in out.items()}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def world(request):
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"], ids=["fp32", "fp16", "bf16"])
def test_kernels_match_float64_and_megatron(world, dtype):
    pytest.importorskip("triton.runtime.interpreter")
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    results = run_distributed(_rank, world, dtype, env=env)
    logits, target, grad = _inputs(getattr(torch, dtype))
    loss, gradient, (loss_bound, grad_bound), (generic_loss, generic_grad) = _exact(
        logits, target, grad, world
    )
    for rank, got in enumerate(results):
        assert got["launches"].count("row_statistics_kernel") == 1, got["launches"]
        assert got["launches"].count("softmax_gradient_kernel") == 1, got["launches"]
        columns = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
        mine, bound = gradient[:, columns], grad_bound[:, columns]
        loss_error = (torch.tensor(got["loss"]).double() - loss).abs()
        assert (loss_error <= loss_bound).all(), (loss_error / loss_bound).max()
        grad_error = (torch.tensor(got["grad"]).double() - mine).abs()
        assert (grad_error <= bound).all(), (grad_error / bound).max()
        if dtype != "float16":  # megatron's unfused one returns a float16 gradient too
            # megatron's within its generic bound of float64, so within the sum of both of ours.
            agree = (torch.tensor(got["megatron_loss"]).double() - torch.tensor(got["loss"])).abs()
            assert (agree <= loss_bound + generic_loss).all(), (agree / generic_loss).max()
            agree = (torch.tensor(got["megatron_grad"]).double() - torch.tensor(got["grad"])).abs()
            assert (agree <= bound + generic_grad[:, columns]).all()
        shifted = (torch.tensor(got["shifted_grad"]).double() - mine).abs()
        assert (shifted > 1000 * bound).any()
        if world > 1:
            alone = (torch.tensor(got["alone_loss"]).double() - loss).abs()
            assert (alone > 1000 * loss_bound).any()
        # Column 4,095 of the flat row left out of S (its logit -inf): beyond this bound, within
        # the generic one.
        dropped = abs(got["dropped_loss"][4] - loss[4].item())
        assert loss_bound[4] < dropped < generic_loss[4], (dropped, loss_bound[4])


def _model_rank(rank: int, world: int) -> dict:
    """``HybridModel``'s loss (its MTP depth's too) with megatron's fused cross entropy asked for
    (the Triton passes run), with it off (megatron's unfused one), megatron's again with the
    Triton run's logit gradients put in its place, and the control: the Triton passes on labels
    one position off. Each run's logits and their gradients are caught at the output layer."""
    from support.triton_interpreter import counting_ranges

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation
    from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config

    enable_cpu_emulation()
    launches: list[str] = []
    counting_ranges(launches.append)
    pattern = "[*-]/*-"
    pg = initialize_model_parallel(tp=world, seed=3)
    config = small_config(pattern, tensor_model_parallel_size=world)
    config.cross_entropy_fusion_impl = "native"
    model = build_hybrid(config, pattern, pg, vocab_size=MODEL_VOCAB)
    batch = model_inputs(batch=2, seq=8, vocab=MODEL_VOCAB, seed=5)
    weights = torch.rand(2, 8, generator=torch.Generator().manual_seed(9)) + 0.5
    caught: dict = {}

    def catch(module, args, output):  # main logits first, then the MTP depth's
        logits = output[0]
        calls = caught.setdefault("logits", [])
        calls.append(logits.detach().clone())
        index = len(calls) - 1

        def gradient(grad):
            caught.setdefault("grads", {})[index] = grad.clone()
            return caught["inject"][index] if "inject" in caught else None

        logits.register_hook(gradient)

    model.output_layer.register_forward_hook(catch)
    out = {}
    for name, fused, labels, inject in (
        ("triton", True, batch["labels"], None),
        ("megatron", False, batch["labels"], None),
        ("megatron_from_triton", False, batch["labels"], "triton"),
        ("control", True, batch["labels"].roll(1, -1), None),
    ):
        config.cross_entropy_loss_fusion = fused
        caught.clear()
        if inject is not None:
            caught["inject"] = out[inject]["logit_grads"]
        model.zero_grad(set_to_none=True)
        loss = model(batch["input_ids"], batch["position_ids"], None, labels=labels)
        (loss * weights).sum().backward()  # [b, s]: a loss mask's place, every token its own
        logits = [_gather_vocab(x, pg.tp) for x in caught["logits"]]
        out[name] = dict(
            path=model.cross_entropy_path, loss=loss.detach(), logits=logits,
            logit_grads=[caught["grads"][i] for i in range(len(logits))],
            grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            launches=list(launches),
        )  # fmt: skip
        launches.clear()
    out["labels"], out["weights"], out["rank"] = batch["labels"], weights, rank
    # Bytes: tensors would travel as shared memory of a process that has ended.
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def _gather_vocab(shard: torch.Tensor, group) -> torch.Tensor:
    """The whole vocabulary's logits from every TP rank's ``[s, b, V / tp]`` shard."""
    parts = [torch.empty_like(shard) for _ in range(group.size())]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, -1)


def test_hybrid_model_loss_runs_the_kernels_as_megatron_runs_its_own():
    """At TP2 with an MTP depth (whose loss goes through the same method) and a weight per token,
    the Triton passes give megatron's unfused logit gradients within the bounds of the kernel
    test, and every parameter gradient is bit for bit what megatron's backward makes of the
    Triton run's logit gradients; the control (labels one position off) leaves the bounds.

    Each row's gradient is ``g (softmax - onehot)``; ``g`` (the token's weight for the main loss,
    MTP's scaling and mask for its depth) is read off megatron's gradient, and must be the
    token's weight for the main loss."""
    pytest.importorskip("triton.runtime.interpreter")
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    world = 2
    shard = MODEL_VOCAB // world
    for payload in run_distributed(_model_rank, world, env=env):
        got = torch.load(io.BytesIO(payload))
        triton, megatron = got["triton"], got["megatron"]
        assert triton["path"] == "Triton", triton["path"]
        assert megatron["path"] == "megatron's (cross_entropy_loss_fusion is off)"
        assert not megatron["launches"], megatron["launches"]
        # The main loss and the MTP depth's: two of each kernel.
        assert triton["launches"].count("row_statistics_kernel") == 2, triton["launches"]
        assert triton["launches"].count("softmax_gradient_kernel") == 2
        columns = slice(got["rank"] * shard, (got["rank"] + 1) * shard)
        calls = len(triton["logits"])
        assert calls == 2, calls
        for call, logits in enumerate(triton["logits"]):
            assert torch.equal(logits, megatron["logits"][call])  # the same forward
            # megatron's _postprocess runs the MTP depths first, then the main loss; depth d
            # predicts the token d places further on (rolled-in labels 0, masked).
            depth = calls - 1 - call
            labels = got["labels"].roll(-depth, -1)
            if depth:
                labels[:, -depth:] = 0
            flat, target = logits.reshape(-1, MODEL_VOCAB), labels.t().reshape(-1)
            ones = torch.ones(flat.size(0))
            unit = _exact(flat, target, ones, world)[1][:, columns]  # softmax - onehot
            theirs = megatron["logit_grads"][call].reshape(-1, shard).double()
            scale = theirs.abs().amax(-1) / unit.abs().amax(-1)
            if depth == 0:  # the weight of each [s, b] row
                want = got["weights"].t().reshape(-1).double()
                assert ((scale - want).abs() <= 1e-3 * want).all(), (scale, want)
            _, exact, (_, bound), (_, generic) = _exact(flat, target, scale, world)
            # The scale read off megatron's gradient carries its error (the generic bound, on
            # the ratio of two maxima twice).
            exact, slack = exact[:, columns], (bound + 2 * generic)[:, columns]
            ours = triton["logit_grads"][call].reshape(-1, shard).double()
            assert ((ours - exact).abs() <= slack).all(), ((ours - exact).abs() / slack).max()
            if depth == 0:
                control = got["control"]["logit_grads"][call].reshape(-1, shard).double()
                assert ((control - exact).abs() > 1000 * slack).any()
        # Not vacuous: megatron's own logit gradients differ from the Triton run's.
        assert not all(map(torch.equal, triton["logit_grads"], megatron["logit_grads"]))
        replayed = got["megatron_from_triton"]["grads"]
        assert set(replayed) == set(triton["grads"]) and len(replayed) > 10
        for name, grad in triton["grads"].items():
            assert torch.equal(grad, replayed[name]), name

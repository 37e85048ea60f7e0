"""The DDP buffer order that puts the routed experts' weights in expert order (CPU, gloo).

``wrap_model_chunks`` builds megatron's DDP with a ``full_param_layout`` in which each
``SequentialMLP``'s expert weights (``linear_fc1`` of every expert, then ``linear_fc2``) lie
next to each other in expert order, so the grouped GEMM multiplies a view of them and adds the
weight gradients into a view of their ``main_grad``. It must change where parameters lie and
nothing else: the same gradients, the same parameters everywhere else, megatron's own buffer
rules. Checkpoints record the order, and distributed-optimizer state saved in another order is
refused before it loads. Controls: megatron's order (no view), gradients compared under a
swapped expert pair.
"""

from __future__ import annotations

import pytest
import torch

PATTERN = "[*E]{2}"


def _chunk(pg, order: str, *, distopt: bool, fast: bool, monkeypatch):
    from megatron_hybrid.modules import hybrid_stack_spec
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training import loop

    # train's GPU wrapping (the distributed optimizer's layout) on the CPU.
    monkeypatch.setattr(loop, "distributed_optimizer", lambda optimizer: distopt)
    config = small_config(PATTERN, num_moe_experts=6)
    spec = hybrid_stack_spec("local", config=config, local_impl="fast") if fast else None
    torch.manual_seed(3)
    (chunk,) = loop.build_model_chunks(
        config, PATTERN, pg, backend="local", vocab_size=128, max_sequence_length=16,
        stack_spec=spec, param_order=order,
    )  # fmt: skip
    return chunk


def _experts(chunk):
    from megatron.core.transformer.moe.experts import SequentialMLP

    return [m for m in chunk.module.modules() if isinstance(m, SequentialMLP)]


def _step(chunk) -> dict[str, torch.Tensor]:
    from megatron_hybrid.testing.models import model_inputs

    chunk.zero_grad_buffer()
    inputs = model_inputs(batch=2, seq=16, vocab=128, seed=1)
    loss = chunk(**inputs).float().sum()
    loss.backward()
    chunk.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in chunk.module.named_parameters()}


ORDERS = [
    pytest.param(False, False, id="ddp-reference"),
    pytest.param(True, False, id="distopt-reference"),
    pytest.param(True, True, id="distopt-fast"),
]


@pytest.mark.parametrize(("distopt", "fast"), ORDERS)
def test_expert_weights_and_main_grads_are_one_view_per_linear(pg, monkeypatch, distopt, fast):
    from megatron_hybrid.modules.fast.grouped_add import stacked_view
    from megatron_hybrid.training.param_order import EXPERTS_ORDER, MEGATRON_ORDER, chunk_order

    for order in (EXPERTS_ORDER, MEGATRON_ORDER):
        viewed = order == EXPERTS_ORDER
        # The distributed optimizer moves the weights into DDP's buffer; plain DDP leaves them
        # where they were built (the grouped experts build each linear's in one storage).
        weights_viewed = viewed if distopt else fast
        chunk = _chunk(pg, order, distopt=distopt, fast=fast, monkeypatch=monkeypatch)
        assert chunk_order([chunk]) == order
        experts = _experts(chunk)
        assert experts and all(type(m).__name__ == ("GroupedGemmExperts" if fast else
                                                    "SequentialMLP") for m in experts)  # fmt: skip
        for module in experts:
            for name in ("linear_fc1", "linear_fc2"):
                weights = [getattr(e, name).weight for e in module.local_experts]
                grads = [w.main_grad for w in weights]
                # Control: megatron's order lays them out in reverse, interleaved: no view.
                assert (stacked_view(weights) is not None) is weights_viewed, (order, name)
                assert (stacked_view(grads) is not None) is viewed, (order, name)


@pytest.mark.parametrize(("distopt", "fast"), ORDERS)
def test_the_order_changes_no_gradient(pg, monkeypatch, distopt, fast):
    from megatron_hybrid.training.param_order import EXPERTS_ORDER, MEGATRON_ORDER

    grads = {}
    for order in (MEGATRON_ORDER, EXPERTS_ORDER):
        grads[order] = _step(_chunk(pg, order, distopt=distopt, fast=fast,
                                    monkeypatch=monkeypatch))  # fmt: skip
    ours, theirs = grads[EXPERTS_ORDER], grads[MEGATRON_ORDER]
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    # Control: the comparison tells two experts' gradients apart.
    a = next(n for n in ours if "local_experts.0.linear_fc1" in n)
    b = a.replace("local_experts.0.", "local_experts.1.")
    assert not torch.equal(ours[a], theirs[b])


def test_the_reversed_walk_meets_each_block_in_order():
    from megatron_hybrid.training.param_order import ordered_for_buffer

    # DDP's list: registration order; megatron walks it backwards.
    params = ["emb", "e0.fc1", "e0.fc2", "e1.fc1", "e1.fc2", "norm", "out"]
    block = ["e0.fc1", "e1.fc1", "e0.fc2", "e1.fc2"]
    walk = ordered_for_buffer(params, [block])[::-1]
    # Where megatron met the block's first weight (e1.fc2), the whole block, in its order.
    assert walk == ["out", "norm", *block, "emb"]
    assert ordered_for_buffer(params, []) == params


def test_frozen_expert_weights_keep_megatrons_place(pg, monkeypatch):
    """LoRA freezes the base: frozen weights are not in DDP's buffer, nothing reorders."""
    from megatron_hybrid.training.param_order import MEGATRON_ORDER, chunk_order

    def build(models):
        for model in models:
            for name, param in model.named_parameters():
                param.requires_grad_("embedding" in name)

    monkeypatch.setattr(
        "megatron_hybrid.training.loop.distributed_optimizer", lambda optimizer: True
    )
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training.loop import build_model_chunks

    config = small_config(PATTERN, num_moe_experts=6)
    (chunk,) = build_model_chunks(
        config, PATTERN, pg, backend="local", vocab_size=128, max_sequence_length=16,
        prepare=build,
    )  # fmt: skip
    assert chunk_order([chunk]) == MEGATRON_ORDER


def test_lora_adapted_experts_keep_megatrons_place(pg, monkeypatch):
    """LoRA on every linear (the experts' too): the adapters train, the wrapped experts are
    no SequentialMLP block; wrapping succeeds in megatron's order."""
    from megatron_hybrid.peft import LoRAConfig, apply_lora
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training.loop import build_model_chunks
    from megatron_hybrid.training.param_order import MEGATRON_ORDER, chunk_order

    monkeypatch.setattr(
        "megatron_hybrid.training.loop.distributed_optimizer", lambda optimizer: True
    )
    config = small_config(PATTERN, num_moe_experts=6)
    (chunk,) = build_model_chunks(
        config, PATTERN, pg, backend="local", vocab_size=128, max_sequence_length=16,
        prepare=lambda models: apply_lora(models, LoRAConfig(rank=2, alpha=4)),
    )  # fmt: skip
    trainable = [n for n, p in chunk.module.named_parameters() if p.requires_grad]
    assert any("local_experts" in n for n in trainable)  # the experts' adapters train
    assert chunk_order([chunk]) == MEGATRON_ORDER


@pytest.mark.parametrize(
    ("common", "distributed", "error"),
    [
        pytest.param({}, False, None, id="cpu-optimizer-any-order"),
        pytest.param({}, True, "'megatron' order, these model chunks are in the 'experts'",
                     id="old-checkpoint"),
        pytest.param({"param_order": "experts"}, True, None, id="same-order"),
        pytest.param({"param_order": "megatron"}, True, "wrap_model_chunks",
                     id="megatron-order"),
    ],
)  # fmt: skip
def test_other_orders_are_refused_before_loading(common, distributed, error, monkeypatch):
    from types import SimpleNamespace

    from megatron_hybrid.training import param_order
    from megatron_hybrid.training.param_order import (
        EXPERTS_ORDER,
        OrderMismatchError,
        check_order,
        mark_chunk,
        order_to_resume,
    )

    chunk = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=distributed))
    mark_chunk(chunk, EXPERTS_ORDER)
    if error is None:
        check_order(common, "ckpt", [chunk])
    else:
        with pytest.raises(OrderMismatchError, match=error):
            check_order(common, "ckpt", [chunk])
    # What train builds to resume it: the saved order (megatron's when none is recorded).
    monkeypatch.setattr(param_order, "read_common", {"ckpt": common}.get)
    resumed = order_to_resume("ckpt")
    mark_chunk(chunk, resumed)
    check_order(common, "ckpt", [chunk])
    assert order_to_resume(None) == EXPERTS_ORDER


def test_unknown_order_is_refused(pg):
    from megatron_hybrid.training.param_order import buffer_layout

    with pytest.raises(ValueError, match="parameter order 'sorted' is not one of"):
        buffer_layout(torch.nn.Linear(2, 2), None, None, pg, "sorted")


def expert_parallel_worker(rank: int, world_size: int) -> list[bool]:
    """At EP2 the experts' weights live in DDP's expert-parallel buffer: whether each expert
    linear's weights and main_grads are one view there (the distributed optimizer's layout)."""
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron_hybrid.modules.fast.grouped_add import stacked_view
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training import loop
    from megatron_hybrid.training.param_order import EXPERTS_ORDER, MEGATRON_ORDER

    loop.distributed_optimizer = lambda optimizer: True  # train's GPU wrapping (this process)
    pg = initialize_model_parallel(ep=2, seed=1)
    found = []
    for order in (EXPERTS_ORDER, MEGATRON_ORDER):
        config = small_config(PATTERN, num_moe_experts=8, expert_model_parallel_size=2)
        (chunk,) = loop.build_model_chunks(
            config, PATTERN, pg, backend="local", vocab_size=128, max_sequence_length=16,
            param_order=order,
        )  # fmt: skip
        assert chunk.expert_parallel_buffers, "EP2 experts have a buffer of their own"
        for module in _experts(chunk):
            for name in ("linear_fc1", "linear_fc2"):
                weights = [getattr(e, name).weight for e in module.local_experts]
                assert len(weights) == 4
                found.append(stacked_view(weights) is not None)
                found.append(stacked_view([w.main_grad for w in weights]) is not None)
    return found


@pytest.mark.distributed
def test_expert_parallel_buffer_in_expert_order():
    from megatron_hybrid.testing.spawn import run_distributed

    # Per rank: 2 layers x 2 linears x (weights, main_grads) in expert order, then megatron's.
    expected = [True] * 8 + [False] * 8
    assert run_distributed(expert_parallel_worker, 2, timeout=300) == [expected, expected]

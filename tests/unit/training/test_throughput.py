"""train's TFLOP/s and MFU: FLOPs of real tokens from the layer formulas, against a hand count;
the device peak table and its override; the numbers a step reports."""

from __future__ import annotations

import pytest

from megatron_hybrid.training.throughput import (
    PEAK_ENV,
    DevicePeak,
    StepFlops,
    device_peak,
    tflops_per_gpu,
    throughput_text,
)

TINY = ("--hidden-size", "8", "--num-attention-heads", "2", "--swiglu", "--disable-bias-linear",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "6",
        "--vocab-size", "10")  # fmt: skip


def _hand_step(lengths) -> int:
    """A training step of ``[*E]`` (hidden 8, 2 heads of 4, SwiGLU experts of 6, top-2 of 4,
    vocabulary 10) on sequences of ``lengths``, written out term by term: three forwards."""
    tokens = sum(lengths)
    pairs = sum(s * (s + 1) // 2 for s in lengths)  # causal (query, key) pairs
    qkv = 2 * tokens * 8 * (2 * 4 + 2 * 2 * 4)  # q of 2 heads, k and v of 2 groups, width 4
    scores_and_values = 2 * (2 * pairs * 2 * 4)
    out_proj = 2 * tokens * 8 * 8
    router = 2 * tokens * 8 * 4
    experts = 2 * (2 * tokens * 8 * 6 * 2 + 2 * tokens * 6 * 8)  # 2 routed; fc1 doubled (GLU)
    output_layer = 2 * tokens * 8 * 10
    return 3 * (qkv + scores_and_values + out_proj + router + experts + output_layer)


@pytest.fixture(scope="module")
def counter():
    from megatron_hybrid.pattern import parse_pattern
    from megatron_hybrid.training.config import config_from_flags

    return StepFlops(config_from_flags("[*E]", *TINY), parse_pattern("[*E]"), 10)


def test_step_flops_equal_a_hand_count(counter):
    assert counter([3, 5]) == _hand_step([3, 5]) == 3 * (3072 + 672 + 1024 + 512 + 4608 + 1280)


def test_padding_is_not_counted(counter):
    """Negative control: the same sequences counted at their padded length (5 and 5) differ;
    empty sequences (padding rows) add nothing."""
    assert counter([5, 5]) == _hand_step([5, 5]) != counter([3, 5])
    assert counter([3, 0, 5]) == counter([3, 5])
    assert counter([]) == 0.0


def test_batches_are_annotated_from_their_lengths(counter):
    batches = counter.annotate([{"sequence_lengths": [3, 5]}, {"num_tokens": 4}])
    assert batches[0]["model_flops"] == _hand_step([3, 5])
    assert "model_flops" not in batches[1]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("NVIDIA H100 80GB HBM3", 989.0, id="h100-sxm"),
        pytest.param("NVIDIA H200", 989.0, id="h200"),
        pytest.param("NVIDIA GH200 480GB", 989.0, id="gh200"),
        pytest.param("NVIDIA H100 PCIe", 756.0, id="h100-pcie"),
        pytest.param("NVIDIA H20", 148.0, id="h20-not-h200"),
        pytest.param("NVIDIA A100-SXM4-80GB", 312.0, id="a100"),
        pytest.param("NVIDIA GeForce RTX 4090", None, id="unknown"),
        pytest.param(None, None, id="cpu"),
    ],
)
def test_peak_by_device_name(name, expected):
    peak = device_peak(name, environ={})
    assert (peak.tflops if peak else None) == expected
    if peak:
        assert "dense bf16 data-sheet peak" in peak.source


def test_peak_from_the_environment():
    assert device_peak("NVIDIA GeForce RTX 4090", {PEAK_ENV: "165.2"}) == DevicePeak(
        165.2, PEAK_ENV
    )
    assert device_peak(None, {PEAK_ENV: "2"}).tflops == 2.0  # overrides the CPU's "none" too
    for bad in ("fast", "0", "-3"):
        with pytest.raises(ValueError, match=rf"^{PEAK_ENV}='{bad}': expected the GPU's peak"):
            device_peak("NVIDIA H100", {PEAK_ENV: bad})


def test_rates_and_text():
    # 3 steps of 2 GPUs: 989e12 FLOPs in 1 s, 2 s, 0.5 s -> 494.5, 247.25, 989 TFLOP/s per GPU.
    rate = tflops_per_gpu([989e12] * 3, [1.0, 2.0, 0.5], gpus=2)
    assert rate == pytest.approx(494.5)
    assert throughput_text(rate, DevicePeak(989.0, "x")) == "494.5 TFLOP/s/GPU, MFU 50.0 %"
    assert throughput_text(rate, None) == "494.5 TFLOP/s/GPU"
    assert throughput_text(None, DevicePeak(989.0, "x")) is None
    assert tflops_per_gpu([0.0], [1.0], gpus=1) is None  # no FLOPs known: no rate
    assert tflops_per_gpu([1e12], [1.0], gpus=0) is None


def test_summary_reports_the_steps_after_warm_up():
    from megatron_hybrid.cli.train import closing_line
    from megatron_hybrid.training.metrics import TrainingSummary

    summary = TrainingSummary(
        first_iteration=0, last_iteration=3, losses=[3.0, 2.0, 1.0], grad_norms=[1.0] * 3,
        saved=None, step_seconds=[60.0, 0.5, 0.5], step_tokens=[100] * 3,
        step_flops=[989e12] * 3, gpus=4, peak=DevicePeak(989.0, "H100"),
    )  # fmt: skip
    # 989 TFLOP per step over 4 GPUs in 0.5 s: 494.5 TFLOP/s per GPU; the 60 s warm-up left out.
    assert summary.throughput == "494.5 TFLOP/s/GPU, MFU 50.0 %"
    assert "| median step 500.0 ms, 200 tok/s | 494.5 TFLOP/s/GPU, MFU 50.0 % |" in closing_line(
        summary
    )
    cpu = TrainingSummary(0, 1, [1.0], [1.0], None, [1.0], [10], [1e9])
    assert cpu.throughput is None and "TFLOP" not in closing_line(cpu)

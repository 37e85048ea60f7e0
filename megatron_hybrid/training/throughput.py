"""Model FLOPs of ``train``'s steps, TFLOP/s per GPU and model FLOP utilisation (MFU).

One truth for ``train`` and ``benchmarks/mfu.py``: a step's FLOPs are the matrix products its
micro-batches' *real* tokens need (padding not counted), from the per-layer-type formulas of
:mod:`megatron_hybrid.modules.flops` (``LayerRuntime.flops``; a training step is three forward
passes), attention counted over each sequence's causal pairs. Each micro-batch carries its
sequence lengths (``sequence_lengths``, host integers: no device read); :class:`StepFlops`
turns them into FLOPs, which ``train_step`` sums over micro-batches and data-parallel ranks.

MFU divides the FLOPs per GPU and second by the GPU's dense bf16 tensor-core peak
(:func:`device_peak`): NVIDIA's data-sheet figure for the device name (the figures "with
sparsity" are twice these and are not used), or ``MEGATRON_HYBRID_PEAK_TFLOPS`` where set (for
a device the table does not know, or another precision). Without a known peak, ``train`` prints
TFLOP/s per GPU and no MFU.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_hybrid.modules.flops import SequenceBatch, model_flops
from megatron_hybrid.pattern import ParsedPattern

__all__ = [
    "BF16_DENSE_PEAK_TFLOPS",
    "PEAK_ENV",
    "DevicePeak",
    "StepFlops",
    "device_peak",
    "throughput_text",
    "tflops_per_gpu",
]

#: Environment variable that sets the peak (TFLOP/s per GPU) MFU divides by.
PEAK_ENV = "MEGATRON_HYBRID_PEAK_TFLOPS"

#: Dense bf16 tensor-core peak in TFLOP/s by a fragment of ``torch.cuda.get_device_name()``,
#: first match wins (NVIDIA's data sheets; SXM parts unless named). H200 and H100 SXM share
#: H100's tensor cores: 989.
BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),  # also GH200
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("B200", 2250.0),
    ("L40S", 362.0),
)


@dataclass(frozen=True)
class DevicePeak:
    """The peak MFU divides by.

    Attributes:
        tflops: dense bf16 TFLOP/s per GPU.
        source: where the figure comes from (for the record).
    """

    tflops: float
    source: str


def device_peak(device_name: str | None, environ: Mapping[str, str] = os.environ):
    """The :class:`DevicePeak` of a device, or None where none is known.

    Args:
        device_name: ``torch.cuda.get_device_name()``; None on the CPU (no peak unless the
            environment sets one).
        environ: where to read :data:`PEAK_ENV`.

    Raises:
        ValueError: :data:`PEAK_ENV` is set to something other than a positive number.
    """
    override = environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(
                f"{PEAK_ENV}={override!r}: expected the GPU's peak in TFLOP/s, a positive number "
                "(e.g. 989 for an H100 SXM in bf16)"
            )
        return DevicePeak(value, PEAK_ENV)
    if device_name is None:
        return None
    for fragment, tflops in BF16_DENSE_PEAK_TFLOPS:
        if fragment in device_name:
            return DevicePeak(tflops, f"{fragment} dense bf16 data-sheet peak")
    return None


class StepFlops:
    """Training FLOPs (forward and backward: three forwards) of sequences of ``train``'s model.

    Args:
        config: the model's ``TransformerConfig``.
        pattern: the parsed layer pattern (the whole model, every pipeline stage).
        vocab_size: the output layer's vocabulary.
    """

    def __init__(self, config, pattern: ParsedPattern, vocab_size: int):
        self.config, self.pattern, self.vocab_size = config, pattern, vocab_size
        self._cache: dict[tuple[int, ...], float] = {}

    def __call__(self, lengths: Sequence[int]) -> float:
        """FLOPs of one training pass over sequences of these real lengths (0 for none)."""
        key = tuple(int(n) for n in lengths if n > 0)
        if not key:
            return 0.0
        if key not in self._cache:
            if len(self._cache) > 4096:  # lengths vary per micro-batch: keep the cache bounded
                self._cache.clear()
            batch = SequenceBatch(key)
            self._cache[key] = float(
                model_flops(self.config, self.pattern, batch, self.vocab_size).step
            )
        return self._cache[key]

    def annotate(self, batches: list[dict]) -> list[dict]:
        """``batches`` with each one's ``model_flops`` set from its ``sequence_lengths`` (a
        batch without lengths gets none: its step reports no FLOPs)."""
        for batch in batches:
            if "sequence_lengths" in batch:
                batch["model_flops"] = self(batch["sequence_lengths"])
        return batches


def tflops_per_gpu(flops: Sequence[float], seconds: Sequence[float], gpus: int):
    """Median TFLOP/s per GPU over steps (None without steps, FLOPs or GPUs)."""
    if gpus < 1:
        return None
    rates = [f / s / gpus / 1e12 for f, s in zip(flops, seconds, strict=True) if f and s > 0]
    if not rates:
        return None
    return statistics.median(rates)


def throughput_text(tflops: float | None, peak: DevicePeak | None) -> str | None:
    """``"412.3 TFLOP/s/GPU, MFU 41.7 %"`` (no MFU without a peak; None without a rate)."""
    if tflops is None:
        return None
    text = f"{tflops:,.1f} TFLOP/s/GPU"
    if peak is not None:
        text += f", MFU {100 * tflops / peak.tflops:.1f} %"
    return text

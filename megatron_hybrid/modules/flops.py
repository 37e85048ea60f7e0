"""Model FLOPs of a hybrid stack: a formula per layer type, summed over the parsed pattern.

Model FLOP utilisation (MFU) divides the arithmetic a step *must* do by what the GPU could do
in the step's time. The arithmetic counted here is the matrix products of the forward pass, a
multiply-add being two FLOPs: projections, attention scores and weighted sums (causal pairs
only), the router, the experts each token is routed to, GatedDeltaNet's and Mamba2's chunked
recurrences, the output layer. Norms, activations, softmaxes and other elementwise work are
left out, as in the usual MFU accounting (PaLM, Megatron-LM); a training step counts the
forward three times (backward: twice the forward), recomputation not included.

Each layer type gives its forward FLOPs in its runtime record (``LayerRuntime.flops``, the
formulas of the built-in types in :mod:`megatron_hybrid.modules.layer_types`), as a function
``(config, batch) -> {part: FLOPs}`` of the model's ``TransformerConfig`` and a
:class:`SequenceBatch`; :func:`model_flops` walks the parsed pattern (MTP depths included) and
adds the output layer. A registered layer type without a formula is an error that says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_hybrid.modules.registry import layer_runtime
from megatron_hybrid.pattern import layer_facts, parse_pattern

__all__ = [
    "ModelFlops",
    "SequenceBatch",
    "linear_flops",
    "model_flops",
]


@dataclasses.dataclass(frozen=True)
class SequenceBatch:
    """The sequences one forward pass computes (a padded batch: ``b`` copies of ``s``; a packed
    batch: its sequence lengths).

    Attributes:
        lengths: tokens per sequence.
    """

    lengths: tuple[int, ...]

    @classmethod
    def uniform(cls, sequences: int, length: int) -> SequenceBatch:
        """``sequences`` sequences of ``length`` tokens each."""
        return cls((length,) * sequences)

    @property
    def tokens(self) -> int:
        """All tokens of the batch."""
        return sum(self.lengths)

    def attended_pairs(self, window: int | None = None) -> int:
        """(query, key) pairs under a causal mask, keys limited to the ``window`` before each
        query where given: ``s (s + 1) / 2`` per sequence without a window."""
        total = 0
        for s in self.lengths:
            if window is None or window + 1 >= s:
                total += s * (s + 1) // 2
            else:  # queries 1..w+1 see all earlier keys, the rest see w + 1 keys
                full = window + 1
                total += full * (full + 1) // 2 + (s - full) * full
        return total


def linear_flops(tokens: int, fan_in: int, fan_out: int) -> int:
    """A dense ``[tokens, fan_in] @ [fan_in, fan_out]`` product: ``2 * tokens * in * out``."""
    return 2 * tokens * fan_in * fan_out


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of a model for one batch, by physical layer and part.

    Attributes:
        layers: ``(symbol, {part: FLOPs})`` per physical layer, main pattern then MTP depths.
        other: FLOPs outside the layers (``output_layer``, MTP ``eh_proj``s, ...).
        batch: the batch counted.
    """

    layers: tuple[tuple[str, Mapping[str, float]], ...]
    other: Mapping[str, float]
    batch: SequenceBatch

    @property
    def forward(self) -> float:
        """All forward FLOPs."""
        return sum(sum(parts.values()) for _, parts in self.layers) + sum(self.other.values())

    @property
    def step(self) -> float:
        """FLOPs of a training step on the batch: forward and backward, three forwards."""
        return 3 * self.forward

    def by_symbol(self) -> dict[str, float]:
        """Forward FLOPs per layer type (symbol), plus the ``other`` parts by name."""
        out: dict[str, float] = {}
        for symbol, parts in self.layers:
            out[symbol] = out.get(symbol, 0) + sum(parts.values())
        for name, value in self.other.items():
            out[name] = out.get(name, 0) + value
        return out

    def mfu(self, step_seconds: float, peak_flops: float, devices: int = 1) -> float:
        """Model FLOP utilisation of a step of ``step_seconds`` on ``devices`` devices of
        ``peak_flops`` each."""
        return self.step / (step_seconds * peak_flops * devices)


def _formula(symbol: str):
    formula = layer_runtime(symbol).flops
    if formula is None:
        raise ValueError(
            f"{layer_facts(symbol).name} ({symbol!r}) has no FLOP formula; give its "
            "LayerRuntime a flops=(config, batch) -> {part: FLOPs} function"
        )
    return formula


def model_flops(
    config: Any, pattern, batch: SequenceBatch, vocab_size: int, *, output_layer: bool = True
) -> ModelFlops:
    """Forward FLOPs of the model ``pattern`` describes, for ``batch``.

    Args:
        config: the model's ``TransformerConfig``.
        pattern: the hybrid pattern (``str`` or ``ParsedPattern``); every layer of every
            pipeline segment counts (the whole model, not one stage).
        batch: the sequences of one forward pass.
        vocab_size: the output layer's vocabulary (padded, as the layer is built).
        output_layer: count the output layer (and each MTP depth's).

    Raises:
        ValueError: a layer type in the pattern has no FLOP formula.
    """
    parsed = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    hidden, tokens = config.hidden_size, batch.tokens
    layers = []
    for segment in parsed.segments:
        for item in segment:
            for symbol in item if isinstance(item, tuple) else (item,):
                layers.append((symbol, dict(_formula(symbol)(config, batch))))
    other: dict[str, float] = {}
    if output_layer:
        other["output_layer"] = linear_flops(tokens, hidden, vocab_size)
    if parsed.mtp_num_depths:
        mtp = parse_pattern(parsed.mtp_pattern)
        for _ in range(parsed.mtp_num_depths):
            other["mtp_eh_proj"] = other.get("mtp_eh_proj", 0) + linear_flops(
                tokens, 2 * hidden, hidden
            )
            for segment in mtp.segments:
                for item in segment:
                    for symbol in item if isinstance(item, tuple) else (item,):
                        layers.append((symbol, dict(_formula(symbol)(config, batch))))
            if output_layer:
                other["mtp_output_layer"] = other.get("mtp_output_layer", 0) + linear_flops(
                    tokens, hidden, vocab_size
                )
    return ModelFlops(tuple(layers), other, batch)

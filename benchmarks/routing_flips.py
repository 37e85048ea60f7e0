"""Routing flips between two runs over the same sequences (packed vs padded), and how much of the
log-prob difference they explain; ``benchmarks/logprobs.py`` reports them.

In bf16 a packed and a padded forward pass round differently (other GEMM shapes, other
reduction orders). Where a token's router scores are close, the rounding can change which top-k
experts it goes to: a *routing flip*. A flip at position ``p`` of a sequence changes that token's
hidden state from its MoE layer on, and, through attention and GatedDeltaNet, every later
position of the sequence in the layers above: the tokens downstream of a flip (positions ``>=
p``) can differ by far more than rounding. :class:`RoutingRecorder` records, during
``forward_logprobs``, every router's chosen experts together with the model input, so that the
choices are put back on ``(sequence, position)`` whatever the micro-batching;
:func:`flip_report` counts the flips per MoE layer and splits the log-prob differences into those
of tokens downstream of a flip and the rest. If flips explain the differences, the rest stay at
rounding level.

Routers see one tensor-parallel rank's sequence shard under sequence parallelism; the recorder is
for one rank (TP 1), as the benchmark runs.
"""

from __future__ import annotations

import torch


def _routers(chunks) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


class RoutingRecorder:
    """Context manager recording each forward's input and each router's top-k experts.

    Args:
        chunks: the model chunk(s) the forward passes run on (TP 1).
        sequences: the token sequences being scored (each identified by its tokens).
    """

    def __init__(self, chunks, sequences) -> None:
        self.chunks = list(chunks) if isinstance(chunks, list | tuple) else [chunks]
        self.routers = _routers(self.chunks)
        self.index = {}
        for i, seq in enumerate(sequences):
            # The model reads a sequence's tokens but its last (a label only): position j of the
            # input is where log-prob j is computed.
            self.index.setdefault(tuple(seq[:-1].tolist()), []).append(i)
        self.calls: list[dict] = []
        self._hooks = []

    def __enter__(self) -> RoutingRecorder:
        self._hooks.append(self.chunks[0].register_forward_pre_hook(self._start, with_kwargs=True))
        for layer, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._route(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _start(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append(
            dict(
                input_ids=ids.detach().cpu(),
                padding_mask=(
                    None
                    if kwargs.get("padding_mask") is None
                    else kwargs["padding_mask"].detach().cpu()
                ),
                params=kwargs.get("packed_seq_params"),
                experts=[None] * len(self.routers),
            )
        )

    def _route(self, layer: int):
        def hook(module, args, output) -> None:
            routing_map = output[1]
            k = module.topk
            if routing_map.dtype == torch.bool:  # [tokens, experts]: k set per row
                chosen = routing_map.nonzero()[:, 1].view(-1, k)
            else:  # [tokens, k] expert indices
                chosen = routing_map.sort(-1).values
            self.calls[-1]["experts"][layer] = chosen.to(torch.int16).cpu()

        return hook

    def expert_sets(self) -> dict[int, torch.Tensor]:
        """Sequence index -> ``[MoE layers, len(sequence), k]`` chosen experts (sorted)."""
        out: dict[int, torch.Tensor] = {}
        for call in self.calls:
            for index, rows in self._sequences(call):
                out[index] = torch.stack([layer[rows] for layer in call["experts"]])
        return out

    def _sequences(self, call):
        """``(sequence index, token rows of the flattened [s, b] router input)`` per sequence."""
        ids, params = call["input_ids"], call["params"]
        batch = ids.size(0)
        if params is not None:  # THD: one row, sequences at cu_seqlens_q_padded
            starts = params.cu_seqlens_q_padded.tolist()
            bounds = params.cu_seqlens_q.tolist()
            pieces = [(starts[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]
            for start, length in pieces:
                rows = torch.arange(start, start + length)
                yield from self._named(ids[0, rows], rows)
            return
        pad = call["padding_mask"]
        for row in range(batch):
            length = int((~pad[row]).sum()) if pad is not None else ids.size(1)
            # The router's tokens are [s, b] flattened: position p of row r is p * b + r.
            rows = torch.arange(length) * batch + row
            yield from self._named(ids[row, :length], rows)

    def _named(self, tokens, rows):
        # A placeholder micro-batch's token is no sequence's input.
        matches = self.index.get(tuple(tokens.tolist()))
        if matches:
            yield matches[0], rows


def flip_report(a: dict, b: dict, differences: list[torch.Tensor]) -> dict:
    """Routing flips between two runs and where the log-prob differences fall.

    Args:
        a, b: :meth:`RoutingRecorder.expert_sets` of the two runs.
        differences: per sequence, ``|logprobs_a - logprobs_b|`` (entry ``j`` computed at
            position ``j``).

    Returns:
        ``flips_per_layer`` (tokens whose expert set differs, per MoE layer), ``tokens``,
        ``tokens_with_flip`` (in any layer), ``downstream_tokens`` (log-prob entries at or
        after a sequence's first flip), ``downstream_share`` (their part of the summed
        difference), ``max_downstream`` and ``max_elsewhere`` (the largest difference of each
        kind).
    """
    layers = next(iter(a.values())).size(0) if a else 0
    per_layer = [0] * layers
    tokens = flipped = downstream = 0
    total = on_downstream = 0.0
    max_down = max_else = 0.0
    for index, diff in enumerate(differences):
        if index not in a or index not in b:
            continue
        flips = (a[index] != b[index]).any(-1)  # [layers, positions]
        for layer in range(layers):
            per_layer[layer] += int(flips[layer].sum())
        any_flip = flips.any(0)
        tokens += any_flip.numel()
        flipped += int(any_flip.sum())
        hits = any_flip.nonzero()
        first = int(hits[0]) if hits.numel() else len(diff) + 1
        diff = diff.double()
        after = torch.arange(len(diff)) >= first
        downstream += int(after.sum())
        total += float(diff.sum())
        on_downstream += float(diff[after].sum())
        if after.any():
            max_down = max(max_down, float(diff[after].max()))
        if (~after).any():
            max_else = max(max_else, float(diff[~after].max()))
    return dict(
        flips_per_layer=per_layer,
        tokens=tokens,
        tokens_with_flip=flipped,
        downstream_tokens=downstream,
        downstream_share=on_downstream / total if total else 0.0,
        max_downstream=max_down,
        max_elsewhere=max_else,
    )

"""Model settings a checkpoint implies, and mismatches named by their flag.

``check-checkpoint`` needs the pattern and the model-shape flags of the model to compare with.
A checkpoint written by ``train`` records them all (the store's common record); for older and
foreign checkpoints the sizes follow from tensor shapes (``embedding.word_embeddings.weight`` is
``[vocab, hidden]``, learned positions ``[positions, hidden]``, a dense MLP's ``linear_fc2`` is
``[hidden, ffn]`` and its ``linear_fc1`` twice as tall with SwiGLU, a router is
``[experts, hidden]``).
:func:`settings_from_checkpoint` returns what it can tell; :func:`mismatched_flags` turns
global-shape mismatches back into the flags that differ.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = ["mismatched_flags", "settings_from_checkpoint"]

# Suffix of a dense MLP's weights in megatron-core's keys (MoE experts have "experts." in them).
_FC1, _FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
_EMBEDDING = "embedding.word_embeddings.weight"
_POSITIONS = "embedding.position_embeddings.weight"
_ROUTER = "mlp.router.weight"


def settings_from_checkpoint(tensors: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """Model-shape flag values (argparse ``dest`` names) implied by a checkpoint's tensors.

    Args:
        tensors: checkpoint key -> global shape (model tensors).
    """
    found: dict[str, Any] = {}
    embedding = tensors.get(_EMBEDDING)
    if embedding is not None and len(embedding) == 2:
        found["vocab_size"], found["hidden_size"] = int(embedding[0]), int(embedding[1])
    positions = tensors.get(_POSITIONS)
    if positions is not None and len(positions) == 2:
        found["position_embedding_type"] = "learned_absolute"
        found["max_position_embeddings"] = int(positions[0])
    found["untie_embeddings_and_output_weights"] = "output_layer.weight" in tensors
    dense_fc2 = next((k for k in sorted(tensors) if k.endswith(_FC2) and "experts" not in k), None)
    if dense_fc2 is not None:
        fc2 = tensors[dense_fc2]
        fc1 = tensors.get(dense_fc2[: -len(_FC2)] + _FC1)
        # A stacked GPT checkpoint has a leading layer dimension: read the last two.
        found["ffn_hidden_size"] = int(fc2[-1])
        if fc1 is not None:
            found["swiglu"] = int(fc1[-2]) == 2 * int(fc2[-1])
        found["disable_bias_linear"] = dense_fc2[: -len("weight")] + "bias" not in tensors
    router = next((k for k in sorted(tensors) if k.endswith(_ROUTER)), None)
    if router is not None:
        found["num_experts"] = int(tensors[router][-2])  # [experts, hidden], maybe stacked
    return found


# Flags whose value shows up as a tensor dimension, in the order they are suspected.
_SHAPE_FLAGS = (
    ("--hidden-size", "hidden_size"),
    ("--vocab-size", "vocab_size"),
    ("--ffn-hidden-size", "ffn_hidden_size"),
    ("--moe-ffn-hidden-size", "moe_ffn_hidden_size"),
    ("--num-experts", "num_experts"),
    ("--max-position-embeddings", "max_position_embeddings"),
)


def _suspects(key: str) -> tuple[str, ...]:
    """Flags whose value can be a dimension of the tensor ``key`` (the rest: hidden size)."""
    if "word_embeddings" in key or key.startswith("output_layer"):
        return ("--vocab-size", "--hidden-size")
    if "position_embeddings" in key:
        return ("--max-position-embeddings", "--seq-length", "--hidden-size")
    if "router" in key:
        return ("--num-experts", "--hidden-size")
    if "experts" in key:
        return ("--moe-ffn-hidden-size", "--num-experts", "--hidden-size")
    if "linear_fc" in key:
        return ("--ffn-hidden-size", "--hidden-size")
    return ("--hidden-size",)


def mismatched_flags(
    mismatches: Sequence[tuple[str, Sequence[int], Sequence[int]]],
    args: Any,
    agreed: Collection[str] = (),
) -> list[str]:
    """``--flag MODEL does not match the checkpoint's CHECKPOINT`` for each identifiable flag.

    A dimension that differs and equals, on the model side, the value of a flag that can size
    that tensor is attributed to the flag; dimensions no flag explains are left out.

    Args:
        mismatches: ``(key, model shape, checkpoint shape)`` triples.
        args: the flags the model was built from.
        agreed: ``dest`` of flags known to equal the checkpoint's (its record says so), or
            that the command has not (``seq_length`` for ``check-checkpoint``): never suspected,
            which matters where two flags have the same value.
    """
    values = {flag: getattr(args, dest, None) for flag, dest in _SHAPE_FLAGS}
    for flag, dest in _SHAPE_FLAGS:
        if dest in agreed:
            values[flag] = None
    if values["--ffn-hidden-size"] is None and values["--hidden-size"]:
        values["--ffn-hidden-size"] = 4 * values["--hidden-size"]
    # train's learned absolute positions default to --seq-length.
    values["--seq-length"] = None
    if getattr(args, "max_position_embeddings", None) is None and "seq_length" not in agreed:
        values["--seq-length"] = getattr(args, "seq_length", None)
    found: dict[str, set[int]] = {}
    for key, model, checkpoint in mismatches:
        if len(model) != len(checkpoint):
            continue
        for want, have in zip(model, checkpoint, strict=True):
            if want == have:
                continue
            flag = next((f for f in _suspects(key) if values[f] == want), None)
            if flag is not None:
                found.setdefault(flag, set()).add(int(have))
    out = []
    for flag, have in found.items():
        theirs = " or ".join(map(str, sorted(have)))
        line = f"{flag} {values[flag]} does not match the checkpoint's {theirs}"
        if flag == "--seq-length":
            line = (
                f"--seq-length {values[flag]} sets the number of learned absolute positions "
                f"(--max-position-embeddings is not given), the checkpoint has {theirs}: use "
                f"--seq-length {theirs}, or shorter sequences with --max-position-embeddings "
                f"{theirs}"
            )
        out.append(line)
    return out

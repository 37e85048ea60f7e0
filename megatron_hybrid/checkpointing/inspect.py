"""Would a ``torch_dist`` checkpoint load into a model? Decided from metadata alone.

:func:`compare_with_checkpoint` reads only the checkpoint's metadata and lists missing,
unexpected and shape-mismatched tensors against the keys a caller expects (for a pattern's
model, :func:`megatron_hybrid.model.expected_checkpoint_tensors` builds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.checkpointing.integrity import CheckpointDamagedError, describe_read_error
from megatron_hybrid.checkpointing.store import resolve_checkpoint_dir

__all__ = [
    "CheckpointComparison",
    "checkpoint_metadata",
    "checkpoint_model_tensors",
    "compare_with_checkpoint",
    "sharded_tensor_shapes",
]

# Checkpoint keys that belong to a language model's parameters; everything else in a training
# checkpoint (optimizer state, RNG state, ...) is not compared.
_MODEL_KEY_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")


@dataclass(frozen=True)
class CheckpointComparison:
    """Result of comparing a pattern's model with a checkpoint.

    Attributes:
        checkpoint_dir: the dist-checkpoint folder that was read.
        missing: model tensors the checkpoint lacks.
        unexpected: model tensors in the checkpoint that the pattern's model does not have.
        shape_mismatches: ``(key, expected global shape, checkpoint global shape)``.
        matched: number of tensors present on both sides with equal shapes.
        metadata: sharded-state-dict metadata used to build the expected keys.
    """

    checkpoint_dir: Path
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    shape_mismatches: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    matched: int
    metadata: dict

    @property
    def loads(self) -> bool:
        """Whether every tensor would load."""
        return not (self.missing or self.unexpected or self.shape_mismatches)


def sharded_tensor_shapes(sharded: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor a sharded state dict saves.

    Factories are built first: a SwiGLU ``linear_fc1`` is a ``ShardedTensorFactory`` that saves
    its gate and value halves under the one key of the whole weight.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shapes = {}
    for value in nested_values(sharded):
        built = nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]
        for tensor in built:
            if isinstance(tensor, ShardedTensor):
                shapes[tensor.key] = tuple(tensor.global_shape)
    return shapes


def checkpoint_model_tensors(checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
    """Model tensors recorded in a checkpoint's metadata (optimizer state etc. left out)."""
    from megatron.core import dist_checkpointing

    tensors = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    return {
        key: tuple(value.global_shape)
        for key, value in tensors.items()
        if key.startswith(_MODEL_KEY_ROOTS)
    }


def checkpoint_metadata(checkpoint_dir: Path, keys) -> dict:
    """The sharded-state-dict metadata a checkpoint was saved with (inferred when absent)."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_content_metadata(str(checkpoint_dir)) or {}
    metadata = {
        k: v for k, v in saved.items() if k in ("non_homogeneous_layers", "singleton_local_shards")
    }
    if not metadata and any(key.startswith("decoder.layers.0.") for key in keys):
        # Indexed layer keys without recorded metadata: a non-homogeneous save.
        metadata["non_homogeneous_layers"] = True
    return metadata


def compare_with_checkpoint(checkpoint_dir: str | Path, build_expected) -> CheckpointComparison:
    """Compare a checkpoint's tensors with the model ``build_expected(metadata)`` describes.

    Args:
        checkpoint_dir: save root or iteration folder.
        build_expected: ``metadata -> {key: global shape}`` (e.g. a partial of
            :func:`megatron_hybrid.model.expected_checkpoint_tensors`).
    """
    folder = resolve_checkpoint_dir(checkpoint_dir)
    try:
        found = checkpoint_model_tensors(folder)
        metadata = checkpoint_metadata(folder, found)
    except BaseException as error:  # noqa: BLE001 - torch's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointDamagedError(
            f"cannot read the metadata of the checkpoint {folder}: {describe_read_error(error)}"
        ) from None
    expected = build_expected(metadata)
    mismatches = tuple(
        (key, shape, found[key])
        for key, shape in sorted(expected.items())
        if key in found and found[key] != shape
    )
    return CheckpointComparison(
        checkpoint_dir=folder,
        missing=tuple(sorted(set(expected) - set(found))),
        unexpected=tuple(sorted(set(found) - set(expected))),
        shape_mismatches=mismatches,
        matched=sum(1 for key, shape in expected.items() if found.get(key) == shape),
        metadata=metadata,
    )

"""``torch_dist`` checkpoints of models converted from Hugging Face, and their HF record.

``convert --from-hf`` writes Megatron-LM's *release* layout (``<root>/release/`` and a tracker
that says ``release``) through the checkpoint store: model weights only, under the package's
checkpoint keys, plus the record of the source model (:data:`~megatron_hybrid.checkpointing.
store.HF_RECORD_FILE`: its ``config.json``, per-tensor dtypes and pattern), so the checkpoint
can be turned back into a Hugging Face folder, and ``train --load`` starts fine-tuning from it
(iteration 0, fresh optimizer). ``train`` writes the same record into the checkpoints of a model
that started from Hugging Face weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_hybrid.checkpointing import store
from megatron_hybrid.checkpointing.sharded import model_sharded_state
from megatron_hybrid.checkpointing.store import COMMON_RECORD, HF_RECORD_FILE, MODEL_ONLY_FORMAT
from megatron_hybrid.hf.config import HFConversion, hf_config_to_megatron
from megatron_hybrid.hf.weights import model_chunks

__all__ = [
    "conversion_of_checkpoint",
    "hf_config_of_checkpoint",
    "hf_dtypes_of_checkpoint",
    "hf_record",
    "read_hf_record",
    "load_model_state",
    "save_model_state",
]


def hf_record(model, conversion: HFConversion | None = None, *, model_only: bool = False) -> dict:
    """What a checkpoint records about a model that came from Hugging Face ({} otherwise).

    Args:
        model: the model (chunks).
        conversion: its conversion (default: the one ``load_hf_model`` attached).
        model_only: the checkpoint holds weights only (an initialisation, not a resume).
    """
    first = model_chunks(model)[0]
    conversion = conversion or getattr(first, "hf_conversion", None)
    if conversion is None:
        return {}
    dtypes = getattr(first, "hf_source_dtypes", None) or {}
    return {
        "hf_config": conversion.hf_config,
        # Each tensor's dtype in the source folder, so that the export writes it back so.
        "hf_dtypes": {name: str(d).removeprefix("torch.") for name, d in dtypes.items()},
        "hybrid_layer_pattern": conversion.pattern.pattern,
        "model_only": model_only,
    }


def read_hf_record(root) -> dict:
    """The HF record of the checkpoint ``root`` resolves to ({} if it has none)."""
    return store.read_record(root, HF_RECORD_FILE) or {}


def save_model_state(model, root, conversion: HFConversion, *, overwrite: bool = False) -> Path:
    """Write the model's weights as a release ``torch_dist`` checkpoint; every rank calls it.

    Raises:
        CheckpointExistsError: ``root`` already holds a checkpoint and ``overwrite`` is False
            (a ``FileExistsError``).
        NonFiniteCheckpointError: a weight is NaN or infinite (named; nothing is written).
    """
    state = {
        **model_sharded_state(model_chunks(model)),
        "iteration": 0,
        COMMON_RECORD: {
            "format": MODEL_ONLY_FORMAT,
            "hybrid_layer_pattern": conversion.pattern.pattern,
        },
    }
    record = hf_record(model, conversion, model_only=True)
    return store.write(root, store.RELEASE, state, {HF_RECORD_FILE: record}, overwrite=overwrite)


def hf_dtypes_of_checkpoint(root) -> dict[str, torch.dtype]:
    """The source Hugging Face dtype of each tensor, as the checkpoint recorded it."""
    dtypes = read_hf_record(root).get("hf_dtypes", {})
    return {name: getattr(torch, dtype) for name, dtype in dtypes.items()}


def hf_config_of_checkpoint(root) -> dict | None:
    """The Hugging Face config a checkpoint records (None if it has none)."""
    return read_hf_record(root).get("hf_config")


def conversion_of_checkpoint(root, hf_config: dict | None = None, **kwargs) -> HFConversion:
    """The conversion of a checkpoint, from ``hf_config`` or the one it stores.

    Raises:
        ValueError: neither is there.
    """
    stored = read_hf_record(root)
    config = hf_config or stored.get("hf_config")
    if config is None:
        raise ValueError(
            f"{root} records no Hugging Face config (it was not written by convert --from-hf or "
            "train --load-hf); pass --hf-config with the config.json of the model"
        )
    pattern = stored.get("hybrid_layer_pattern")
    # The stored pattern says whether MTP layers were converted (HF configs declare them even
    # where the weights were dropped).
    mtp = None if pattern is None else "/" in pattern
    return hf_config_to_megatron(config, mtp=mtp, has_tensor=lambda name: True, **kwargs)


def load_model_state(model, root) -> Path:
    """Load a checkpoint's model weights (no optimizer state) into ``model``, strictly.

    Files are verified and non-finite values refused by name (the store's reader).

    Returns:
        The checkpoint folder that was read.
    """
    return store.read_model_state(root, model_chunks(model))

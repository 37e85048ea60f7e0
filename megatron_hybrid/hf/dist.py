"""``torch_dist`` checkpoints of models converted from Hugging Face.

``convert --from-hf`` writes Megatron-LM's *release* layout (``<root>/release/`` and a tracker
that says ``release``): model weights only, under the package's checkpoint keys, plus the source
``config.json`` in the common state, so the checkpoint can be turned back into a Hugging Face
folder, and ``train --load`` starts fine-tuning from it (iteration 0, fresh optimizer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.inspect import (
    TRACKER_FILE,
    iteration_folder_name,
    resolve_checkpoint_dir,
)
from megatron_hybrid.hf.config import HFConversion, hf_config_to_megatron
from megatron_hybrid.hf.weights import model_chunks

__all__ = [
    "HF_RECORD_FILE",
    "MODEL_ONLY_FORMAT",
    "conversion_of_checkpoint",
    "hf_config_of_checkpoint",
    "hf_dtypes_of_checkpoint",
    "hf_record",
    "read_hf_record",
    "write_hf_record",
    "load_model_state",
    "save_model_state",
]

#: ``megatron_hybrid.format`` of a weights-only checkpoint.
MODEL_ONLY_FORMAT = "megatron_hybrid/model-only/1"

#: A small JSON file in the iteration folder that says which Hugging Face model a checkpoint
#: holds: readable without touching the checkpoint's data files (which may be damaged), and
#: covered by the integrity manifest.
HF_RECORD_FILE = "hf_model.json"


def hf_record(model, conversion: HFConversion | None = None) -> dict:
    """What a checkpoint records about a model that came from Hugging Face ({} otherwise)."""
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
    }


def write_hf_record(folder, record: dict, *, model_only: bool = False) -> None:
    """Write :data:`HF_RECORD_FILE` (rank 0; nothing if ``record`` is empty)."""
    if record:
        record = {**record, "model_only": model_only}
        (Path(folder) / HF_RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_hf_record(root) -> dict:
    """The record of the checkpoint ``root`` resolves to ({} if it has none)."""
    path = resolve_checkpoint_dir(root) / HF_RECORD_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _model_state(model) -> dict:
    from megatron_hybrid.checkpointing.sharded import model_sharded_state

    return model_sharded_state(model_chunks(model))


def save_model_state(model, root, conversion: HFConversion, *, overwrite: bool = False) -> Path:
    """Write the model's weights as a release ``torch_dist`` checkpoint; every rank calls it.

    Raises:
        FileExistsError: ``root`` already holds a checkpoint and ``overwrite`` is False.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    root = Path(root)
    folder = root / iteration_folder_name("release")
    if (folder.exists() or (root / TRACKER_FILE).exists()) and not overwrite:
        raise FileExistsError(
            f"{root} already holds a checkpoint; choose another --save folder or remove it"
        )
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {
        **_model_state(model),
        "iteration": 0,
        "megatron_hybrid": {
            "format": MODEL_ONLY_FORMAT,
            "hybrid_layer_pattern": conversion.pattern.pattern,
        },
    }
    dist_checkpointing.save(state, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        from megatron_hybrid.checkpointing.integrity import write_integrity_manifest

        write_hf_record(folder, hf_record(model, conversion), model_only=True)
        write_integrity_manifest(folder)
        tmp = root / f".{TRACKER_FILE}.tmp"
        tmp.write_text("release")
        os.replace(tmp, root / TRACKER_FILE)
    dist.barrier()
    return folder


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


def load_model_state(model, root) -> None:
    """Load a checkpoint's model weights (no optimizer state) into ``model``, strictly."""
    from megatron.core import dist_checkpointing

    folder = resolve_checkpoint_dir(root)
    chunks = model_chunks(model)
    state = dist_checkpointing.load(_model_state(model), str(folder))
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)

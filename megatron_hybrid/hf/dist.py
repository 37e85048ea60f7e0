"""``torch_dist`` checkpoints of models converted from Hugging Face.

``convert --from-hf`` writes Megatron-LM's *release* layout (``<root>/release/`` and a tracker
that says ``release``): model weights only, under the package's checkpoint keys, plus the source
``config.json`` in the common state, so the checkpoint can be turned back into a Hugging Face
folder, and ``train --load`` starts fine-tuning from it (iteration 0, fresh optimizer).

What the source was beyond the model's weights travels in the iteration folder too, so the
checkpoint stays self-contained: :data:`HF_RECORD_FILE` (the whole config.json with its
``quantization_config``, each tensor's stored dtype, the name prefix) and
:data:`HF_TENSORS_FILE` (the source's FP8 scales, and the tensors of parts the model does not
compute, such as a multimodal checkpoint's vision tower, carried through untouched).
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
    "HF_TENSORS_FILE",
    "MODEL_ONLY_FORMAT",
    "conversion_of_checkpoint",
    "hf_config_of_checkpoint",
    "hf_dtypes_of_checkpoint",
    "hf_record",
    "hf_record_tensors",
    "read_hf_record",
    "restore_hf_source",
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
#: Tensors of the source that are no model weight: FP8 scales (``*_scale_inv``) and carried
#: tensors (named in the record's ``carried``). Covered by the integrity manifest.
HF_TENSORS_FILE = "hf_tensors.safetensors"


def hf_record(model, conversion: HFConversion | None = None) -> dict:
    """What a checkpoint records about a model that came from Hugging Face ({} otherwise)."""
    first = model_chunks(model)[0]
    conversion = conversion or getattr(first, "hf_conversion", None)
    if conversion is None:
        return {}
    dtypes = getattr(first, "hf_source_dtypes", None) or {}
    return {
        # The whole config.json (a multimodal one with its vision_config), quantization_config
        # included: export writes the source format again from it.
        "hf_config": conversion.config_json,
        "hf_prefix": conversion.hf_prefix,
        # Each tensor's dtype in the source folder, so that the export writes it back so.
        "hf_dtypes": {name: str(d).removeprefix("torch.") for name, d in dtypes.items()},
        "hybrid_layer_pattern": conversion.pattern.pattern,
        "carried": sorted(getattr(first, "hf_carried", None) or {}),
    }


def hf_record_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors :data:`HF_TENSORS_FILE` holds for ``model``: its source FP8 scales and, on
    global rank 0 (the writer), its carried tensors."""
    first = model_chunks(model)[0]
    return {
        **(getattr(first, "hf_fp8_scales", None) or {}),
        **(getattr(first, "hf_carried", None) or {}),
    }


def write_hf_record(folder, record: dict, *, model_only: bool = False, tensors=None) -> None:
    """Write :data:`HF_RECORD_FILE`, and :data:`HF_TENSORS_FILE` when there are ``tensors``
    (rank 0; nothing if ``record`` is empty)."""
    if record:
        if tensors:
            from safetensors.torch import save_file

            save_file(
                {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
                Path(folder) / HF_TENSORS_FILE,
                metadata={"format": "pt"},
            )
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
    taken = folder.exists() or (root / TRACKER_FILE).exists()
    dist.barrier()  # every rank looks before rank 0 creates the folder
    if taken and not overwrite:
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

        write_hf_record(
            folder,
            hf_record(model, conversion),
            model_only=True,
            tensors=hf_record_tensors(model),
        )
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
    conversion = hf_config_to_megatron(config, mtp=mtp, has_tensor=lambda name: True, **kwargs)
    if hf_config is None and stored.get("hf_prefix"):
        conversion.hf_prefix = stored["hf_prefix"]
    return conversion


def restore_hf_source(model, root) -> None:
    """Give a model loaded from checkpoint ``root`` what it keeps of its Hugging Face source
    (as ``load_hf_weights`` does): each tensor's stored dtype, the FP8 scales, and on global
    rank 0 the carried tensors.

    Raises:
        ValueError: the record names tensors the checkpoint folder does not hold.
    """
    import torch.distributed as dist
    from safetensors import safe_open

    record = read_hf_record(root)
    dtypes = {name: getattr(torch, d) for name, d in record.get("hf_dtypes", {}).items()}
    carried_names = set(record.get("carried", ()))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    scales, carried = {}, {}
    path = resolve_checkpoint_dir(root) / HF_TENSORS_FILE
    if path.is_file():
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                if name not in carried_names:
                    scales[name] = handle.get_tensor(name)
                elif rank0:
                    carried[name] = handle.get_tensor(name)
    missing = sorted(carried_names - set(carried)) if rank0 else []
    if missing:
        raise ValueError(
            f"{root} records {len(missing)} carried tensors ({missing[0]}, ...) that its "
            f"{HF_TENSORS_FILE} does not hold; the checkpoint is incomplete"
        )
    for chunk in model_chunks(model):
        chunk.hf_source_dtypes = dtypes
        chunk.hf_fp8_scales = scales
        chunk.hf_carried = carried


def load_model_state(model, root) -> None:
    """Load a checkpoint's model weights (no optimizer state) into ``model``, strictly."""
    from megatron.core import dist_checkpointing

    folder = resolve_checkpoint_dir(root)
    chunks = model_chunks(model)
    state = dist_checkpointing.load(_model_state(model), str(folder))
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)

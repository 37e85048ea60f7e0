"""``torch_dist`` checkpoints of models converted from Hugging Face, and their HF record.

``convert --from-hf`` writes Megatron-LM's *release* layout (``<root>/release/`` and a tracker
that says ``release``) through the checkpoint store: model weights only, under the package's
checkpoint keys, plus the record of the source model (:data:`~megatron_hybrid.checkpointing.
store.HF_RECORD_FILE`: its ``config.json``, per-tensor dtypes and pattern), so the checkpoint
can be turned back into a Hugging Face folder, and ``train --load`` starts fine-tuning from it
(iteration 0, fresh optimizer). ``train`` writes the same record into the checkpoints of a model
that started from Hugging Face weights.

What the source was beyond the model's weights travels in the checkpoint too, so that it stays
self-contained and the export writes the source format again: the record holds the whole
config.json (with its ``quantization_config`` and ``vision_config``), each tensor's stored dtype
and the names' prefix, and the checkpoint's state holds, outside the model's keys
(:func:`hf_source_state`), the source's FP8 scales (``hf_source.scales.<name>``) and the tensors
of parts the model does not compute (``hf_source.carried.<name>``: a multimodal checkpoint's
vision tower), which :func:`restore_hf_source` gives back to a model loaded from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_hybrid.checkpointing import store
from megatron_hybrid.checkpointing.sharded import model_sharded_state
from megatron_hybrid.checkpointing.store import (
    COMMON_RECORD,
    HF_FILES_DIR,
    HF_RECORD_FILE,
    MODEL_ONLY_FORMAT,
)
from megatron_hybrid.hf.config import HFConversion, hf_config_to_megatron
from megatron_hybrid.hf.io import side_files
from megatron_hybrid.hf.weights import model_chunks

__all__ = [
    "HF_SOURCE_KEY",
    "carried_files",
    "conversion_of_checkpoint",
    "hf_config_of_checkpoint",
    "hf_dtypes_of_checkpoint",
    "hf_record",
    "hf_source_state",
    "read_hf_record",
    "restore_hf_source",
    "load_model_state",
    "save_model_state",
]

#: Where a checkpoint's state holds the source's tensors that are no model weight (outside the
#: model's key roots): FP8 scales and carried tensors.
HF_SOURCE_KEY = "hf_source"
_SCALES = f"{HF_SOURCE_KEY}.scales."
_CARRIED = f"{HF_SOURCE_KEY}.carried."


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
    path = getattr(first, "hf_source_path", None)
    return {
        # The folder the weights came from (absolute): a command that writes may not replace it.
        "hf_path": None if path is None else os.path.abspath(path),
        # The whole config.json (a multimodal one with its vision_config), quantization_config
        # included: export writes the source format again from it.
        "hf_config": getattr(conversion, "config_json", conversion.hf_config),
        "hf_prefix": getattr(conversion, "hf_prefix", None),
        # Each tensor's dtype in the source folder, so that the export writes it back so.
        "hf_dtypes": {name: str(d).removeprefix("torch.") for name, d in dtypes.items()},
        "hybrid_layer_pattern": conversion.pattern.pattern,
        "carried": sorted(getattr(first, "hf_carried", None) or {}),
        "model_only": model_only,
    }


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def hf_source_state(model) -> dict:
    """The checkpoint entries of the source's tensors that are no model weight: the FP8 scales
    (held by every rank; the first writes them) and the carried tensors (held by global rank
    0), as ``ShardedTensor`` under keys outside the model's roots ({} when there are none)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    first = model_chunks(model)[0]
    rank = _rank()
    entries = {}
    for prefix, tensors, replica in (
        (_SCALES, getattr(first, "hf_fp8_scales", None) or {}, rank),
        (_CARRIED, getattr(first, "hf_carried", None) or {}, 0),
    ):
        for name, tensor in tensors.items():
            data = tensor.detach().to("cpu").contiguous()
            entries[prefix + name] = ShardedTensor.from_rank_offsets(
                prefix + name, data, replica_id=replica
            )
    return entries


def carried_files(model) -> dict[str, Path]:
    """The store's ``files`` for the files serving needs that the model carries (tokenizer,
    generation config, chat template: ``hf_side_files``), under
    :data:`~megatron_hybrid.checkpointing.store.HF_FILES_DIR`."""
    files = getattr(model_chunks(model)[0], "hf_side_files", None) or {}
    return {f"{HF_FILES_DIR}/{name}": Path(path) for name, path in files.items()}


def read_hf_record(root) -> dict:
    """The HF record of the checkpoint ``root`` resolves to ({} if it has none)."""
    return store.read_record(root, HF_RECORD_FILE) or {}


def save_model_state(
    model, root, conversion: HFConversion, *, overwrite: bool = False, sources=None
) -> Path:
    """Write the model's weights as a release ``torch_dist`` checkpoint; every rank calls it.

    The root is written whole beside its place and moved in complete (the store's
    ``replace_root``), with the source's tokenizer files in ``hf_files/``.

    Args:
        overwrite: replace what ``root`` holds (refused otherwise when it is not empty).
        sources: ``role -> path`` the caller reads; ``root`` may not overlap one. The model's
            Hugging Face folder is always one.

    Raises:
        CheckpointExistsError: ``root`` is not empty and ``overwrite`` is False (a
            ``FileExistsError``).
        NonFiniteCheckpointError: a weight is NaN or infinite (named; nothing is written).
        OutputError, OutputWriteError: ``root`` may not be written, or writing failed (``root``
            is then as it was).
    """
    state = {
        **model_sharded_state(model_chunks(model)),
        "iteration": 0,
        COMMON_RECORD: {
            "format": MODEL_ONLY_FORMAT,
            "hybrid_layer_pattern": conversion.pattern.pattern,
        },
        HF_SOURCE_KEY: hf_source_state(model),
    }
    record = hf_record(model, conversion, model_only=True)
    own = {"the Hugging Face source": record.get("hf_path")}
    return store.write(
        root,
        store.RELEASE,
        state,
        {HF_RECORD_FILE: record},
        files=carried_files(model),
        overwrite=overwrite,
        sources={**own, **(sources or {})},
    )


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
    """Give a model loaded from the checkpoint ``root`` what it keeps of its Hugging Face source
    (as ``load_hf_weights`` does): each tensor's stored dtype, the FP8 scales, on global rank 0
    the carried tensors, the files serving needs (``hf_files/``) and the recorded source folder.
    Collective (every rank calls it).

    Raises:
        CheckpointDamagedError: the record names carried tensors the checkpoint does not hold.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    record = read_hf_record(root)
    dtypes = {name: getattr(torch, d) for name, d in record.get("hf_dtypes", {}).items()}
    folder = store.resolve_checkpoint_dir(root)
    saved = {
        key: meta
        for key, meta in dist_checkpointing.load_tensors_metadata(str(folder)).items()
        if key.startswith(HF_SOURCE_KEY + ".")
    }
    missing = sorted(set(record.get("carried", ())) - {k[len(_CARRIED) :] for k in saved})
    if missing:
        raise store.CheckpointDamagedError(
            f"{folder} records {len(missing)} carried tensors ({missing[0]}, ...) that it does "
            "not hold; the checkpoint is incomplete"
        )
    # Every rank reads the scales (as replicas: one main replica per tensor), rank 0 the rest.
    request = {
        key: ShardedTensor.from_rank_offsets(
            key, torch.empty(tuple(meta.global_shape), dtype=meta.dtype), replica_id=_rank()
        )
        for key, meta in saved.items()
        if key.startswith(_SCALES) or _rank() == 0
    }
    loaded = store.read(folder, {HF_SOURCE_KEY: request}).get(HF_SOURCE_KEY, {}) if saved else {}
    scales = {k[len(_SCALES) :]: t for k, t in loaded.items() if k.startswith(_SCALES)}
    carried = {k[len(_CARRIED) :]: t for k, t in loaded.items() if k.startswith(_CARRIED)}
    files = side_files(folder / HF_FILES_DIR)
    for chunk in model_chunks(model):
        chunk.hf_source_dtypes = dtypes
        chunk.hf_fp8_scales = scales
        chunk.hf_carried = carried
        chunk.hf_side_files = files
        if record.get("hf_path"):
            chunk.hf_source_path = record["hf_path"]


def load_model_state(model, root) -> Path:
    """Load a checkpoint's model weights (no optimizer state) into ``model``, strictly.

    Files are verified and non-finite values refused by name (the store's reader).

    Returns:
        The checkpoint folder that was read.
    """
    return store.read_model_state(root, model_chunks(model))

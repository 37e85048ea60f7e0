"""Adapter-only ``torch_dist`` checkpoints: the adapters' sharded state, their record, and the
fingerprint of the base they were trained on.

The adapters' tensors take the base weights' checkpoint keys with ``lora_A`` / ``lora_B`` in
them (:func:`~megatron_hybrid.peft.layout.adapter_entries`), in the key form the base's own
checkpoint uses, so an adapter checkpoint reshards over TP / EP / PP as the base does and its
optimizer state (keyed by the same entries) follows. The record (:data:`LORA_RECORD`) holds the
:class:`~megatron_hybrid.peft.config.LoRAConfig`, where the base came from and its fingerprint:
the base's config and a digest of its tensor manifest. A resume or export against another base
is refused by comparing fingerprints.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.store import (
    HF_RECORD_FILE,
    INTEGRITY_FILE,
    resolve_checkpoint_dir,
)
from megatron_hybrid.hf.io import CONFIG_FILE
from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.peft.apply import lora_state
from megatron_hybrid.peft.config import LoRAConfig, LoRAConfigError
from megatron_hybrid.peft.layout import adapter_entries, row_chunks, weight_entries

__all__ = [
    "ADAPTER_FORMAT",
    "LORA_RECORD",
    "BaseMismatchError",
    "base_fingerprint",
    "check_base",
    "load_adapter_state",
    "lora_record",
    "lora_sharded_state",
]

#: File name of the adapter record in a checkpoint folder.
LORA_RECORD = "lora.json"
#: ``format`` of an adapter-only checkpoint.
ADAPTER_FORMAT = "megatron_hybrid/lora-adapter/1"
#: Bytes of each weight file's data hashed into the fingerprint (besides its header and size):
#: another model of the same architecture differs there already.
_SAMPLE = 1 << 20


class BaseMismatchError(LoRAConfigError):
    """An adapter met a base other than the one it was trained on."""


def lora_sharded_state(chunks, metadata: dict | None = None) -> dict:
    """The adapters' part of a checkpoint: ``{"model": {param: entry}}`` (``model0``,
    ``model1``, ... per virtual stage), entries derived from the base's sharded state dict with
    the same ``metadata``."""
    models = model_chunks(chunks)
    out = {}
    for i, chunk in enumerate(models):
        state = getattr(chunk, "lora_state", None)
        entries = {}
        if state is not None and state.adapted:
            sharded = chunk.sharded_state_dict(metadata=metadata)
            names = {id(p): n for n, p in chunk.named_parameters()}
            weights = [w for cand in state.adapted for w in cand.info.weights]
            found = weight_entries(sharded, weights)
            for cand in state.adapted:
                adapter = cand.module.lora
                for j, weight in enumerate(cand.info.weights):
                    entry = found[id(weight)]
                    a, b = adapter.a(j), adapter.b(j)
                    a_entry, b_entry = adapter_entries(
                        entry.key,
                        row_chunks(entry, weight),
                        weight,
                        a,
                        b,
                        cand.info.tp_rank,
                        cand.info.mode,
                    )
                    entries[names[id(a)]] = a_entry
                    entries[names[id(b)]] = b_entry
        out["model" if len(models) == 1 else f"model{i}"] = entries
    return out


@torch.no_grad()
def load_adapter_state(chunks, loaded: dict) -> None:
    """Copy a loaded :func:`lora_sharded_state` into the adapters."""
    models = model_chunks(chunks)
    for i, chunk in enumerate(models):
        part = loaded["model" if len(models) == 1 else f"model{i}"]
        params = dict(chunk.named_parameters())
        for name, value in part.items():
            params[name].copy_(value)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hf_fingerprint(folder: Path) -> dict:
    config = json.loads((folder / CONFIG_FILE).read_text())
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as stream:
            size = int.from_bytes(stream.read(8), "little")
            header = stream.read(size)
            digest.update(file.name.encode() + header + stream.read(_SAMPLE))
        digest.update(str(file.stat().st_size).encode())
    return {
        "config": _sha(json.dumps(config, sort_keys=True).encode()),
        "tensors": digest.hexdigest(),
    }


def _checkpoint_fingerprint(path) -> dict:
    folder = resolve_checkpoint_dir(path)
    record = folder / HF_RECORD_FILE
    config = _sha(record.read_bytes()) if record.is_file() else None
    manifest = folder / INTEGRITY_FILE
    if manifest.is_file():  # SHA-256 of every file, written by the store
        tensors = _sha(manifest.read_bytes())
    else:
        digest = hashlib.sha256()
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                digest.update(f"{file.relative_to(folder)}:{file.stat().st_size}".encode())
        tensors = digest.hexdigest()
    return {"config": config, "tensors": tensors}


def base_fingerprint(*, hf_path=None, checkpoint=None) -> dict:
    """The fingerprint of a base: its config and a digest of its tensor manifest.

    For a Hugging Face folder: config.json, and every safetensors file's header (names, dtypes,
    shapes, offsets), size and first MiB of data; for a ``torch_dist`` checkpoint: its Hugging
    Face record and its integrity manifest (the SHA-256 of every file). Reads a few MiB.
    """
    if (hf_path is None) == (checkpoint is None):
        raise ValueError("base_fingerprint: give hf_path or checkpoint")
    if hf_path is not None:
        return {"kind": "hf", **_hf_fingerprint(Path(hf_path))}
    return {"kind": "torch_dist", **_checkpoint_fingerprint(checkpoint)}


def lora_record(model, *, base: dict) -> dict:
    """The :data:`LORA_RECORD` of an adapted model trained on ``base`` (``{"hf": path,
    "checkpoint": path, "fingerprint": ...}``)."""
    state = lora_state(model)
    if state is None:
        raise LoRAConfigError("the model has no LoRA adapters")
    return {"format": ADAPTER_FORMAT, "lora": state.config.to_dict(), "base": dict(base)}


def config_of_record(record: dict) -> LoRAConfig:
    """The :class:`LoRAConfig` an adapter record holds."""
    return LoRAConfig.from_dict(record["lora"])


def check_base(record: dict, fingerprint: dict, *, where: str, base: str) -> None:
    """Refuse a base whose fingerprint differs from the one the adapter was trained on.

    Args:
        record: the adapter checkpoint's :data:`LORA_RECORD`.
        fingerprint: the fingerprint of the base at hand.
        where: the adapter checkpoint (for the message).
        base: the base at hand (for the message).

    Raises:
        BaseMismatchError: naming both bases and what differs.
    """
    trained = record.get("base", {})
    expected = trained.get("fingerprint", {})
    differ = [k for k in ("config", "tensors") if expected.get(k) != fingerprint.get(k)]
    if expected.get("kind") != fingerprint.get("kind"):
        differ = ["kind"] + differ
    if differ:
        source = trained.get("hf") or trained.get("checkpoint") or "an unrecorded base"
        what = " and ".join({"kind": "its kind", "config": "its config",
                             "tensors": "its weights"}[k] for k in differ)  # fmt: skip
        raise BaseMismatchError(
            f"the adapter {where} was trained on the base {source}; {base} differs in {what}, "
            "so the adapter would not compute what it learned: give the same base"
        )

"""Writing a Hugging Face folder: the weights streamed through :func:`iter_hf_weights` into
sharded safetensors, config.json, the source's side files and a generation config, the folder
complete or untouched (``checkpointing/outputs.py``)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.outputs import Output
from megatron_hybrid.hf.config import HFConversion, dtype_name, family_named
from megatron_hybrid.hf.fp8 import SCALE_SUFFIX, dequantize_tensors, recipe_config
from megatron_hybrid.hf.io import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    HFCheckpointWriter,
    side_files,
)
from megatron_hybrid.hf.stream import iter_hf_weights
from megatron_hybrid.hf.weights import HFWeightsError, model_chunks

__all__ = ["export_config", "generation_config", "save_hf_checkpoint"]


def save_hf_checkpoint(
    model,
    out,
    *,
    quantize: str = "source",
    conversion: HFConversion | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    group=None,
    source_path=None,
    merge_lora: bool | None = None,
    overwrite: bool = False,
    sources=None,
) -> Path | None:
    """Write the model as a Hugging Face folder: sharded safetensors, index, config.json, and
    what serving needs beside them.

    Call on every rank; rank 0 writes. Tensors stream through :func:`iter_hf_weights`, so no
    rank holds the whole model. The folder is written beside ``out`` and moved into place
    complete (``checkpointing/outputs.py``): a failure or Ctrl-C on any rank leaves ``out`` as
    it was, and every rank raises. The source's tokenizer, chat template and processor files
    and its ``generation_config.json`` (:data:`~megatron_hybrid.hf.io.SIDE_FILES`) go with it:
    those of ``source_path``, or those the model carries (``hf_side_files``: from the Hugging
    Face folder it was loaded from, or the checkpoint that carried them); without a
    ``generation_config.json`` one is made from config.json's token ids, as transformers'
    ``save_pretrained`` does. The tensors of declared parts the model does not compute (a
    multimodal checkpoint's vision tower, ``hf_carried``) are written back as they came (with
    ``quantize`` other than ``"source"``, an FP8 one dequantized to ``dtype``, the recipes
    keeping them unquantized), and then config.json is the source's whole (its
    ``architectures`` and ``vision_config``), so transformers loads the class the model started
    from.

    Args:
        model: the model (chunks) on this rank.
        out: output folder (created, with missing parents; a new or empty one unless
            ``overwrite``).
        quantize: ``"source"``, ``"fp8"`` or ``"none"``, as :func:`iter_hf_weights`;
            config.json's ``quantization_config`` says what was written.
        conversion: the model's conversion (default: the one attached by ``load_hf_model``).
        dtype: output dtype of unquantized tensors (default: the source checkpoint's dtype per
            tensor).
        max_shard_size: largest safetensors file, e.g. ``"5GB"``.
        group: process group over all model ranks (default: the world).
        source_path: Hugging Face folder whose side files (tokenizer, ...) to copy instead of
            the ones the model carries.
        merge_lora: for a model with LoRA adapters, True writes the weights with the
            adapters merged (a plain Hugging Face model of the fine-tuned weights), False the
            base weights alone; it must be said for such a model (see :func:`iter_hf_weights`).
        overwrite: replace what ``out`` holds (its old contents are removed once the new folder
            is complete, never mixed with it).
        sources: ``role -> path`` of folders the caller reads (the base, the checkpoint): ``out``
            may not be, lie inside or hold one of them, ``overwrite`` or not. The model's own
            Hugging Face source and ``source_path`` are always among them.

    Returns:
        The folder on rank 0, None elsewhere.

    Raises:
        OutputError, OutputExistsError: ``out`` may not be written (checked before any tensor
            is gathered).
        OutputWriteError: writing failed (a full disk, ...); ``out`` is as it was.
    """
    chunks = model_chunks(model)
    conversion = conversion or getattr(chunks[0], "hf_conversion", None)
    if conversion is None:
        raise HFWeightsError("save_hf_checkpoint needs conversion=... for a model not from HF")
    carried_files = (
        side_files(source_path)
        if source_path
        else dict(getattr(chunks[0], "hf_side_files", None) or {})
    )
    own = {"the model's Hugging Face source": getattr(chunks[0], "hf_source_path", None),
           "source_path": source_path}  # fmt: skip
    sources = {**own, **(sources or {})}
    with Output(out, overwrite=overwrite, sources=sources, group=group) as output:
        writer = HFCheckpointWriter(output.path, max_shard_size) if output.first else None
        matrices, fp8 = set(), set()
        stream = iter_hf_weights(
            model,
            quantize=quantize,
            conversion=conversion,
            dtype=dtype,
            group=group,
            merge_lora=merge_lora,
        )
        for name, tensor in stream:
            if name.endswith(SCALE_SUFFIX):
                fp8.add(name.removesuffix(SCALE_SUFFIX))
            elif tensor.dim() == 2:
                matrices.add(name)
            if writer is not None:
                # A failure (a full disk) is kept, not raised: this rank must go on taking part
                # in the gathers of the stream; every rank raises it at the end.
                output.run(writer.add, name, tensor)
        if writer is not None:
            output.run(
                _finish_folder,
                writer,
                chunks[0],
                conversion,
                quantize=quantize,
                dtype=dtype,
                matrices=matrices,
                fp8=fp8,
                side=carried_files,
            )
    return Path(out) if output.first else None


def _finish_folder(writer, chunk, conversion, *, quantize, dtype, matrices, fp8, side) -> None:
    """Rank 0's end of an export: carried tensors, the last shard and index, config.json, the
    side files and a generation config."""
    out = writer.out
    carried = getattr(chunk, "hf_carried", None) or {}
    if quantize != "source" and conversion.quantization is not None:
        # The releases keep the vision tower unquantized, and a folder without FP8 (or with the
        # recipe's blocks) must hold no FP8 weight in the source's blocks: carried FP8 weights
        # are written dequantized.
        block = conversion.quantization.block
        carried = dequantize_tensors(carried, block, dtype or conversion.dtype)
    for name, tensor in carried.items():
        writer.add(name, tensor)
        if tensor.dim() == 2:
            matrices.add(name)
    writer.close()
    config = export_config(
        conversion,
        quantize=quantize,
        dtype=dtype,
        whole=bool(carried),
        unquantized=[n.removesuffix(".weight") for n in matrices - fp8 if n.endswith(".weight")],
        wrote_fp8=bool(fp8),
    )
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, source in side.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out / name)
    if GENERATION_CONFIG_FILE not in side:
        (out / GENERATION_CONFIG_FILE).write_text(
            json.dumps(generation_config(config), indent=2, sort_keys=True) + "\n"
        )


#: config.json fields that transformers' ``GenerationConfig.from_model_config`` takes over.
_GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def generation_config(config: dict) -> dict:
    """The ``generation_config.json`` of a folder whose source had none: the token ids of its
    config.json (or of its ``text_config``), as ``save_pretrained`` derives it."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    values = {"_from_model_config": True}
    for field in _GENERATION_FIELDS:
        # transformers writes absent ids as explicit nulls (a multimodal config's top level):
        # null counts as absent, as GenerationConfig.from_model_config reads it.
        value = config.get(field)
        if value is None:
            value = text.get(field)
        if value is not None:
            values[field] = value
    return values


def export_config(
    conversion: HFConversion,
    *,
    quantize: str = "source",
    dtype: torch.dtype | None = None,
    whole: bool = False,
    unquantized=(),
    wrote_fp8: bool = False,
) -> dict:
    """config.json of an exported folder.

    Args:
        conversion: the model's conversion.
        quantize: the ``quantize`` mode the tensors were written with.
        dtype: the dtype forced on unquantized tensors (None: the source's).
        whole: write the source's config.json whole (a multimodal one whose other parts were
            carried through) instead of the language model's.
        unquantized: modules whose 2-D weights were written unquantized (``"fp8"``: they make
            ``modules_to_not_convert``).
        wrote_fp8: whether any FP8 weight was written.
    """
    if whole:
        config = copy.deepcopy(conversion.config_json)
    else:
        config = family_named(conversion.family).to_hf_config(conversion)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    parts = [part for part in (config, text) if part is not None]
    if quantize != "source" or not wrote_fp8:
        for part in parts:
            part.pop("quantization_config", None)
    if quantize == "fp8" and wrote_fp8:
        config["quantization_config"] = recipe_config(unquantized)
    if dtype is not None:
        for part in parts:
            part["dtype"] = dtype_name(dtype)
            part.pop("torch_dtype", None)
    return config

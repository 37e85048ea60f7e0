"""Reading and writing Hugging Face checkpoint folders (``config.json`` + safetensors).

:class:`HFCheckpoint` opens a folder lazily: it reads the index (or the one safetensors file's
header) up front and a tensor, or a slice of one, only when asked, so each rank reads only what
its shards need. :class:`HFCheckpointWriter` writes tensors as they come into safetensors files
of bounded size and finishes with ``model.safetensors.index.json``, the layout
``save_pretrained`` writes and inference engines load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_hybrid.checkpointing.finite import tensor_is_finite

__all__ = [
    "GENERATION_CONFIG_FILE",
    "SIDE_FILES",
    "HFCheckpoint",
    "HFCheckpointError",
    "HFCheckpointWriter",
    "HFTensors",
    "parse_size",
    "require_finite",
    "side_files",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: Files of a Hugging Face model folder that serving needs beside config.json and the weights
#: (the names transformers 5.23 saves and reads: ``tokenization_utils_base.py``,
#: ``utils/hub.py``, ``utils/__init__.py``): the tokenizer (fast and slow), the generation
#: defaults, chat templates, processor configs. Folders are taken whole.
SIDE_FILES = (
    GENERATION_CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
)


def side_files(folder: str | os.PathLike | None) -> dict[str, Path]:
    """The :data:`SIDE_FILES` a folder holds: relative name (``chat_template.jinja``,
    ``additional_chat_templates/tool.jinja``) -> file ({} for None or a missing folder)."""
    if folder is None or not Path(folder).is_dir():
        return {}
    folder = Path(folder)
    found = {}
    for name in SIDE_FILES:
        path = folder / name
        if name.endswith("/") and path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                found[file.relative_to(folder).as_posix()] = file
        elif path.is_file():
            found[name] = path
    return found


class HFCheckpointError(ValueError):
    """A Hugging Face folder that cannot be read as a checkpoint."""


class HFCheckpoint:
    """A Hugging Face checkpoint folder, read lazily.

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` or a sharded set with
            ``model.safetensors.index.json``.

    Raises:
        HFCheckpointError: the folder, its config, its index or a safetensors file's header is
            missing or malformed (a truncated shard is found here, before any work).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise HFCheckpointError(f"{self.path} is not a folder (expected a Hugging Face model)")
        config_file = self.path / CONFIG_FILE
        if not config_file.is_file():
            raise HFCheckpointError(
                f"{self.path} has no {CONFIG_FILE}; is it a Hugging Face model?"
            )
        try:
            self.config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise HFCheckpointError(f"{config_file} is not valid JSON: {error}") from None
        if not isinstance(self.config, dict):
            raise HFCheckpointError(f"{config_file} holds no JSON object")
        self._handles: dict[str, object] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("not an object")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
                raise HFCheckpointError(f"{index_file} has no valid weight_map: {error}") from None
        elif (self.path / SINGLE_FILE).is_file():
            weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            raise HFCheckpointError(
                f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors "
                "checkpoints are read (convert .bin files with transformers first)"
            )
        missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
        if missing:
            raise HFCheckpointError(f"{index_file} names files that do not exist: {missing}")
        self.weight_map: dict[str, str] = dict(weight_map)
        # Every file's header now: a truncated or foreign file is named before any work starts,
        # and so is a tensor stored in two files (which one the index names would be a guess).
        holder: dict[str, str] = {}
        for file in sorted(set(self.weight_map.values())):
            held = set(self._open(file).keys())
            absent = sorted(n for n, f in self.weight_map.items() if f == file and n not in held)
            if absent:
                raise HFCheckpointError(
                    f"{index_file} places {len(absent)} tensor(s) in {self.path / file} that it "
                    f"does not hold, e.g. {absent[0]!r}; the index and the files disagree"
                )
            for name in sorted(held):
                if name in holder:
                    raise HFCheckpointError(
                        f"{self.path}: tensor {name} is stored twice, in {self.path / holder[name]}"
                        f" and in {self.path / file}; remove it from one of them (the index names "
                        f"{self.weight_map.get(name)!r})"
                    )
                holder[name] = file

    def _open(self, file: str):
        """The open safetensors file ``file`` (its header read and checked)."""
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(self.path / file, "pt")
            except (SafetensorError, OSError) as error:
                raise HFCheckpointError(
                    f"{self.path / file} is damaged ({error}): it is not a complete safetensors "
                    "file; download or copy it again"
                ) from None
        return self._handles[file]

    def _handle(self, name: str):
        try:
            file = self.weight_map[name]
        except KeyError:
            raise HFCheckpointError(f"{self.path} has no tensor {name!r}") from None
        return self._open(file)

    def file_of(self, name: str) -> Path:
        """The safetensors file that holds the tensor ``name``."""
        return self.path / self.weight_map[name]

    def names(self) -> list[str]:
        """Every tensor name, in the index's order."""
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of a tensor, from the file header (no data read)."""
        if name not in self._meta:
            sl = self._handle(name).get_slice(name)
            self._meta[name] = (sl.get_dtype(), tuple(sl.get_shape()))
        dtype, shape = self._meta[name]
        if dtype not in _DTYPES:
            raise HFCheckpointError(
                f"{self.file_of(name)}: tensor {name} has dtype {dtype}, which is not read"
            )
        return _DTYPES[dtype], shape

    def get(self, name: str) -> torch.Tensor:
        """A whole tensor."""
        return self._handle(name).get_tensor(name)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """A box of a tensor (step-1 slices per dimension), reading only those bytes."""
        return self._handle(name).get_slice(name)[index]

    def close(self) -> None:
        """Release the open files."""
        self._handles.clear()


class HFTensors(HFCheckpoint):
    """Tensors by Hugging Face name, held in memory and read like a folder.

    What an ``iter_hf_weights`` stream collected into a dict becomes, so that
    :func:`~megatron_hybrid.hf.load_hf_weights` loads it into another model (an engine's copy,
    the sampler's model) with the same plan, checks and shard reads as a folder.

    Args:
        tensors: Hugging Face name -> tensor (CPU or not).
        config: the config.json the names belong to (the conversion's ``config_json``).
        label: how messages name the source.
    """

    def __init__(self, tensors, config: dict, label: str = "<tensors in memory>") -> None:
        # No files: the folder's reader state is replaced by the mapping.
        self.path = Path(label)
        self.config = config
        self.weight_map = {name: label for name in tensors}
        self._tensors = dict(tensors)
        self._handles = {}
        self._meta = {}

    def file_of(self, name: str) -> Path:
        return self.path

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        tensor = self.get(name)
        return tensor.dtype, tuple(tensor.shape)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise HFCheckpointError(f"{self.path} has no tensor {name!r}") from None

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.get(name)[index].to("cpu")


def require_finite(source: HFCheckpoint, name: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` read for the tensor ``name`` of ``source``, refused if any is NaN or infinite.

    The read path calls it on what it hands to the model (after any dequantization), so a
    non-finite source is refused by name and file before anything is written or trained.

    Raises:
        HFCheckpointError: naming the tensor and its file.
    """
    if not bool(tensor_is_finite(values)):
        raise HFCheckpointError(
            f"{source.file_of(name)}: tensor {name} has NaN or infinite values; the checkpoint "
            "is refused (nothing was converted or trained); repair or re-download it"
        )
    return values


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``/``500MB``/``4096`` (decimal units, as ``save_pretrained``).

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size(1000)
    (5000000000, 2097152, 1000)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        text = str(size).strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
        for unit, factor in units.items():
            if text.endswith(unit) and text[: -len(unit)].strip().isascii():
                try:
                    value = int(float(text[: -len(unit)]) * factor)
                except ValueError:
                    break
                break
        else:
            value = int(text) if text.isascii() and text.isdigit() else -1
    if value <= 0:
        raise ValueError(f"shard size {size!r} is not a positive size such as '5GB' or '500MB'")
    return value


class HFCheckpointWriter:
    """Write tensors into safetensors shards of at most ``max_shard_size`` bytes, plus the index.

    Tensors are buffered until a shard is full, so memory stays below one shard. ``close`` writes
    the last shard, renames the shards to ``model-0000i-of-0000n.safetensors`` and writes the index
    (a single shard is named ``model.safetensors``, with no index, as ``save_pretrained`` does).
    """

    def __init__(self, out: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_shard_size = parse_size(max_shard_size)
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self._shards: list[list[str]] = []
        self._total = 0
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (moved to CPU, made contiguous)."""
        if name in self._seen:
            raise ValueError(f"tensor {name!r} written twice")
        self._seen.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffered + size > self.max_shard_size:
            self._flush()
        self._buffer[name] = tensor.detach().to("cpu").contiguous()
        self._buffered += size
        self._total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self._shards)
        save_file(self._buffer, self.out / f".shard-{index}.tmp", metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffered = {}, 0

    def close(self) -> list[str]:
        """Finish the checkpoint; returns the file names written."""
        if self._buffer or not self._shards:
            self._flush()
        count = len(self._shards)
        names = (
            [SINGLE_FILE]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for i, name in enumerate(names):
            os.replace(self.out / f".shard-{i}.tmp", self.out / name)
        index = self.out / INDEX_FILE
        if count > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in shard}
            index.write_text(
                json.dumps(
                    {"metadata": {"total_size": self._total}, "weight_map": weight_map},
                    indent=2,
                    sort_keys=True,
                )
                + "\n"
            )
        elif index.exists():
            index.unlink()
        return names

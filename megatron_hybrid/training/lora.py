"""LoRA runs of ``train``: the frozen base, the adapters, and what their checkpoints record.

``train --load-hf HF --lora-rank R ... --save RUN`` trains adapters on the Hugging Face base
(``--load-base CKPT``: a ``torch_dist`` base); the same command with ``--load RUN`` resumes
(base from the flags or, without them, from where the run's record says it came from; adapters
and optimizer from RUN; the base's fingerprint compared with the recorded one). ``--load-peft``
starts from a PEFT adapter. Checkpoints hold the adapters and their optimizer state only
(:mod:`megatron_hybrid.peft.checkpoint`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_hybrid.checkpointing.store import read_model_state, read_record
from megatron_hybrid.hf.config import conversion_for
from megatron_hybrid.hf.dist import conversion_of_checkpoint, read_hf_record
from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.peft import apply_lora, load_peft_adapter
from megatron_hybrid.peft.apply import lora_state
from megatron_hybrid.peft.checkpoint import (
    LORA_RECORD,
    BaseMismatchError,
    base_fingerprint,
    check_base,
    config_of_record,
)
from megatron_hybrid.peft.config import LoRAConfig, LoRAConfigError
from megatron_hybrid.training.hf_source import HFSource
from megatron_hybrid.training.lora_rules import lora_config_from_flags
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = [
    "BaseMismatchError",
    "LoRARun",
    "adapter_record",
    "check_resumable",
    "lora_run",
    "parameter_counts",
]


def adapter_record(load: str | None) -> dict | None:
    """The adapter record of the checkpoint ``--load`` resolves to (None: not an adapter
    checkpoint, or nothing saved there yet)."""
    if not load:
        return None
    try:
        return read_record(load, LORA_RECORD)
    except (OSError, ValueError):
        return None


@dataclass
class LoRARun:
    """The LoRA side of a ``train`` run.

    Attributes:
        config: the adapters' config (None: from ``--load-peft``).
        peft: a PEFT folder to start the adapters from.
        hf_path: the Hugging Face base folder, or None.
        checkpoint: the ``torch_dist`` base checkpoint, or None.
        conversion: the base's Hugging Face conversion (None for a base without one).
        fingerprint: the base's fingerprint.
        resumed: the adapter record of ``--load`` when the run resumes one.
        dropout: ``--lora-dropout`` for adapters from ``peft`` (None: the file's).
    """

    config: LoRAConfig | None
    peft: str | None
    hf_path: str | None
    checkpoint: str | None
    conversion: object
    fingerprint: dict
    resumed: dict | None = None
    dropout: float | None = None

    @property
    def base(self) -> dict:
        """Where the base came from, as the adapter record keeps it."""
        return {"hf": self.hf_path, "checkpoint": self.checkpoint, "fingerprint": self.fingerprint}

    def source(self):
        """The :class:`~megatron_hybrid.training.hf_source.HFSource` of an HF-converted base
        (None for a base without a conversion)."""
        if self.conversion is None:
            return None
        return HFSource(self.conversion, hf_path=self.hf_path, checkpoint=self.checkpoint)

    def attach(self, models: list) -> None:
        """Adapters on the bare model chunks (before DDP wraps them)."""
        for chunk in model_chunks(models):
            if self.conversion is not None:
                chunk.hf_conversion = self.conversion
            if self.hf_path is not None:
                chunk.hf_source_path = self.hf_path
        if self.peft is not None:
            load_peft_adapter(models, self.peft, dropout=self.dropout)
        else:
            apply_lora(models, self.config, conversion=self.conversion)
        for chunk in model_chunks(models):
            chunk.lora_state.base_info = self.base

    def load_base(self, chunks) -> None:
        """The base weights of a base without a Hugging Face conversion (a plain checkpoint)."""
        if self.conversion is None:
            read_model_state(self.checkpoint, chunks)


def _absolute(path: str | None) -> str | None:
    """A path as recorded: absolute, so that a checkpoint names its base from anywhere."""
    import os

    return None if path is None else os.path.abspath(path)


def lora_run(args: TrainSettings) -> LoRARun | None:
    """The LoRA side of a run, or None for a run without adapters.

    Raises:
        BaseMismatchError: ``--load`` holds adapters trained on another base.
        LoRAConfigError: flags that contradict the adapters being resumed.
    """
    record = adapter_record(args.load)
    if args.lora_rank is None and not args.load_peft and record is None:
        return None
    trained = (record or {}).get("base", {})
    hf_path = _absolute(args.load_hf) or (None if args.load_base else trained.get("hf"))
    checkpoint = _absolute(args.load_base) or (None if args.load_hf else trained.get("checkpoint"))
    if hf_path is None and checkpoint is None:
        raise LoRAConfigError(
            "LoRA trains adapters on a pretrained base: add --load-hf HF_DIR or --load-base CKPT"
        )
    if hf_path is not None:
        conversion = conversion_for(hf_path)
        fingerprint = base_fingerprint(hf_path=hf_path)
    else:
        conversion = conversion_of_checkpoint(checkpoint) if read_hf_record(checkpoint) else None
        fingerprint = base_fingerprint(checkpoint=checkpoint)
    config = None
    if record is not None:
        check_base(record, fingerprint, where=str(args.load), base=hf_path or checkpoint)
        config = config_of_record(record)
        config = _resumed_config(config, args)
    elif args.lora_rank is not None:
        config = lora_config_from_flags(args)
    peft = None if record is not None else args.load_peft
    return LoRARun(
        config, peft, hf_path, checkpoint, conversion, fingerprint, record, args.lora_dropout
    )


#: ``--lora-*`` flag -> the LoRAConfig field it sets (``--lora-rank`` as given; the others
#: through :func:`lora_config_from_flags`' normalisation).
_RESUMED_FLAGS = {
    "--lora-rank": "rank",
    "--lora-alpha": "alpha",
    "--lora-targets": "targets",
    "--lora-exclude": "exclude",
}


def _same(value):
    """A config value compared regardless of the order names were listed in."""
    return frozenset(value) if isinstance(value, tuple) else value


def _resumed_config(config: LoRAConfig, args: TrainSettings) -> LoRAConfig:
    """The config of the adapters ``--load`` resumes, checked against the flags given with it.

    A flag that changes the adapters (rank, alpha, targets, exclude) must agree with the record,
    or the flag would be ignored silently; ``--lora-dropout`` (training only) applies.
    """
    given = {}
    for flag, name in _RESUMED_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            given[name] = value
    wanted = dataclasses.replace(config, **given)  # normalised like the record's
    differ = [
        flag
        for flag, name in _RESUMED_FLAGS.items()
        if name in given and _same(getattr(wanted, name)) != _same(getattr(config, name))
    ]
    if differ:
        mine = ", ".join(f"{f} {getattr(config, _RESUMED_FLAGS[f])!r}" for f in differ)
        raise LoRAConfigError(
            f"--load {args.load} holds adapters with {mine}; {', '.join(differ)} would be "
            "ignored: drop them or give the run's values (another adapter config needs a new "
            "run, e.g. started with --load-peft from this one's convert --to-peft)"
        )
    if args.lora_dropout is not None:
        config = dataclasses.replace(config, dropout=args.lora_dropout)
    return config


def check_resumable(run: LoRARun, chunks, folder) -> None:
    """Refuse, before loading, adapters whose configuration differs from this run's."""
    record = read_record(folder, LORA_RECORD)
    if record is None:
        raise LoRAConfigError(
            f"--load {folder} holds no LoRA adapters (no {LORA_RECORD}): a LoRA run resumes "
            "its own adapter checkpoints"
        )
    ours = lora_state(chunks).config.to_dict()
    theirs = record.get("lora", {})
    differ = sorted(k for k in ours if ours[k] != theirs.get(k) and k != "dropout")
    if differ:
        raise LoRAConfigError(
            f"--load {folder} holds adapters with other {', '.join(differ)} "
            f"({ {k: theirs.get(k) for k in differ} }) than this run's "
            f"({ {k: ours[k] for k in differ} }); resume with the run's own settings"
        )


def parameter_counts(chunks, pg) -> tuple[int, int]:
    """``(trainable, total)`` parameters of the whole model (each shard counted once)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.utils import unwrap_model

    counts = torch.zeros(4, dtype=torch.float64)  # dense trainable, dense, expert ..., expert
    for chunk in unwrap_model(list(chunks)):
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            base = 0 if getattr(param, "allreduce", True) else 2
            counts[base + 1] += param.numel()
            if param.requires_grad:
                counts[base] += param.numel()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    dense, expert = counts[:2].to(device), counts[2:].to(device)
    torch.distributed.all_reduce(dense, group=pg.mp)
    torch.distributed.all_reduce(expert, group=pg.tp_ep_pp)
    return int(dense[0] + expert[0]), int(dense[1] + expert[1])

"""A checkpoint's model settings completing the flags: what ``check-checkpoint`` compares with and
what ``logprobs --load`` builds.

A ``train`` checkpoint records every model flag's value (the store's common record, ``model``);
older and foreign checkpoints their pattern, and their tensor shapes imply the sizes
(:func:`~megatron_hybrid.checkpointing.settings.settings_from_checkpoint`). Flags given on the
command line (``TrainSettings.given``) are kept and compared; the others take the checkpoint's
value, else their default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_hybrid.checkpointing.inspect import checkpoint_model_tensors
from megatron_hybrid.checkpointing.settings import settings_from_checkpoint
from megatron_hybrid.checkpointing.store import common_record, read_common
from megatron_hybrid.training.arguments import model_setting_dests
from megatron_hybrid.training.train_settings import TrainSettings, flag_defaults

__all__ = ["RecordedSettings", "flag_text", "recorded_settings_of"]


def flag_text(dest: str, value) -> str:
    """A setting as the flag that gives it (``--hidden-size 64``, ``--swiglu``, ...)."""
    flag = "--" + dest.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return f"no {flag}"
    if dest == "hybrid_layer_pattern":
        return f"{flag}={value!r}"
    return f"{flag} {value}"


@dataclass(frozen=True)
class RecordedSettings:
    """The flags completed from a checkpoint.

    Attributes:
        args: the flags: those given, the checkpoint's for the others, else the defaults.
        read: the settings read from the checkpoint that are not the flags' defaults (as flags).
        differ: the given flags the checkpoint contradicts, with its value.
        agreed: ``dest`` of the settings equal to the checkpoint's.
        recorded: whether the checkpoint records its pattern (else it must be given).
    """

    args: TrainSettings
    read: list[str]
    differ: list[str]
    agreed: set[str]
    recorded: bool


def recorded_settings_of(args: TrainSettings, folder) -> RecordedSettings:
    """The model settings of ``args`` completed from the checkpoint ``folder``."""
    dests = model_setting_dests()
    defaults = flag_defaults()
    given = {d: getattr(args, d) for d in dests if d in args.given}
    record = common_record(read_common(folder))
    recorded = record.get("model")
    if not isinstance(recorded, dict):  # older or foreign checkpoints: the tensors' word
        recorded = settings_from_checkpoint(checkpoint_model_tensors(folder))
        if record.get("hybrid_layer_pattern"):
            recorded["hybrid_layer_pattern"] = record["hybrid_layer_pattern"]
    values, read, differ = dict(given), [], []
    for dest in dests:
        if dest not in recorded:
            continue
        have = recorded[dest]
        if dest not in given:
            values[dest] = have
            if have != defaults.get(dest):
                read.append(flag_text(dest, have))
        elif have is not None and given[dest] != have:
            differ.append(f"{flag_text(dest, given[dest])} (the checkpoint's: "
                          f"{flag_text(dest, have)})")  # fmt: skip
    for dest in dests:
        values.setdefault(dest, defaults.get(dest))
    agreed = {d for d in recorded if recorded[d] is not None and values.get(d) == recorded[d]}
    return RecordedSettings(
        args=dataclasses.replace(args, **values),
        read=read,
        differ=differ,
        agreed=agreed,
        recorded=bool(given.get("hybrid_layer_pattern") or recorded.get("hybrid_layer_pattern")),
    )

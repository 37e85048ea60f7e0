"""The LoRA flags of ``train``: their rules (checked with every other rule, before anything is
built) and the adapters' config they give. The LoRA run itself is :mod:`.lora`."""

from __future__ import annotations

from megatron_hybrid.peft.config import LoRAConfig, LoRAConfigError
from megatron_hybrid.training.settings import Settings, SettingsError, rule
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = ["LORA_RULES", "lora_config_from_flags", "validate_lora_flags"]

_OPTIONS = ("--lora-alpha", "--lora-targets", "--lora-exclude", "--lora-dropout")


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _lora_flags(s: Settings) -> str | None:
    enabled = s.args.lora_rank is not None or s.args.load_peft
    given = [o for o in _OPTIONS if getattr(s.args, _dest(o), None) is not None]
    if given and not enabled and not s.args.load:
        return f"{', '.join(given)} set(s) up LoRA adapters: add --lora-rank R"
    if s.args.load_peft:
        fixed = [o for o in ("--lora-rank", *_OPTIONS[:3]) if getattr(s.args, _dest(o)) is not None]
        if fixed:
            return (
                f"--load-peft {s.args.load_peft} brings its own rank, alpha and targets; drop "
                f"{', '.join(fixed)} (--lora-dropout may be given)"
            )
    if s.args.load_base and not enabled and not s.args.load:
        return "--load-base gives the frozen base of a LoRA run: add --lora-rank R"
    if s.args.load_base and s.args.load_hf:
        return "--load-base and --load-hf both give the base: choose one"
    if enabled and not (s.args.load_hf or s.args.load_base or s.args.load):
        return "LoRA trains adapters on a pretrained base: add --load-hf HF_DIR or --load-base CKPT"
    try:
        lora_config_from_flags(s.args) if s.args.lora_rank is not None else None
    except LoRAConfigError as error:
        return (
            str(error)
            .replace("LoRAConfig: rank", "--lora-rank")
            .replace("LoRAConfig: alpha", "--lora-alpha")
            .replace("LoRAConfig: dropout", "--lora-dropout")
        )
    return None


#: The LoRA flags' rules (checked with the others, before anything is built).
LORA_RULES = (
    rule("train", "--lora-rank --load-base --load-peft " + " ".join(_OPTIONS), _lora_flags),
)


def validate_lora_flags(args: TrainSettings) -> None:
    """Check the LoRA flags (:data:`LORA_RULES`) before they decide where the base comes from.

    Raises:
        SettingsError: naming the flag and the fix.
    """
    settings = Settings(args, 1, False)
    for each in LORA_RULES:
        problem = each.problem(settings)
        if problem:
            raise SettingsError(problem)


def lora_config_from_flags(args: TrainSettings) -> LoRAConfig:
    """The adapters' config the ``--lora-*`` flags give (``--lora-rank`` set)."""
    return LoRAConfig(
        rank=args.lora_rank,
        alpha=args.lora_alpha if args.lora_alpha is not None else args.lora_rank,
        dropout=args.lora_dropout or 0.0,
        targets=args.lora_targets or "all-linear",
        exclude=args.lora_exclude or (),
    )

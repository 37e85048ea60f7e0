"""Every setting checked before work starts: one table of rules over the parsed flags.

megatron-core rejects many flag combinations only deep inside model or process-group
construction (a bare ``AssertionError``, ``ZeroDivisionError`` or a kernel's index error), and
some it accepts although they train wrongly (a negative ``--clip-grad`` reverses the update,
``--moe-router-topk 0`` routes no token). :func:`validate_settings` checks the flags against
:data:`RULES` before any process group or model exists and raises :class:`SettingsError` naming
the flag and the fix. The world size comes from ``WORLD_SIZE`` (torchrun sets it), so every rank
reaches the same verdict without communicating; the CLI prints it on rank 0 only.

Rules come in scopes: ``model`` (what the layers need; ``check-checkpoint`` uses only these),
``device`` (kernels and libraries this machine must have), ``parallel`` (process-group layout)
and ``train`` (the ``train`` command's loop, data and checkpoint folders). The requirements
cited follow megatron-core 0.19.2 (``transformer/transformer_config.py``, ``parallel_state.py``).
"""

from __future__ import annotations

import os

from megatron_hybrid.training import capabilities
from megatron_hybrid.training.arguments import PATTERN_REQUIRED, dest_of
from megatron_hybrid.training.data_rules import DATA_RULES
from megatron_hybrid.training.lora_rules import LORA_RULES
from megatron_hybrid.training.model_rules import DEVICE_RULES, MODEL_RULES
from megatron_hybrid.training.parallel_rules import PARALLEL_RULES, TRAIN_RULES
from megatron_hybrid.training.settings import SCOPES, Rule, Settings, SettingsError, rule
from megatron_hybrid.training.train_settings import TrainSettings, require_settings

__all__ = [
    "RULES",
    "SCOPES",
    "Rule",
    "Settings",
    "SettingsError",
    "validate_settings",
]


def _at_least(scope: str, flag: str, minimum: float, why: str) -> Rule:
    """``flag`` must be >= ``minimum`` when set (None means: use the default)."""

    def problem(s: Settings) -> str | None:
        value = getattr(s.args, dest_of(flag), None)
        if value is None or value >= minimum:
            return None
        return f"{flag} {value} must be >= {minimum}{why}"

    return Rule(scope, (flag,), problem)


# Sizes and counts that must be positive (megatron-core divides by most of them):
# (scope, flag, minimum, why).
_MINIMUMS: tuple[tuple[str, str, float, str], ...] = (
    ("parallel", "--tensor-model-parallel-size", 1, ""),
    ("parallel", "--pipeline-model-parallel-size", 1, ""),
    ("parallel", "--expert-model-parallel-size", 1, ""),
    ("parallel", "--expert-tensor-parallel-size", 1, ""),
    ("parallel", "--context-parallel-size", 1, ""),
    ("model", "--hidden-size", 1, ""),
    ("model", "--num-attention-heads", 1, ""),
    ("model", "--num-query-groups", 1, ""),
    ("model", "--kv-channels", 1, ""),
    ("model", "--ffn-hidden-size", 1, ""),
    ("model", "--vocab-size", 1, ""),
    ("model", "--max-position-embeddings", 1, ""),
    ("model", "--num-experts", 1, ""),
    ("model", "--moe-router-topk", 1, " (each token goes to at least one expert)"),
    ("model", "--moe-ffn-hidden-size", 1, ""),
    ("model", "--moe-shared-expert-intermediate-size", 1, ""),
    ("model", "--moe-aux-loss-coeff", 0, ""),
    ("model", "--q-lora-rank", 1, ""),
    ("model", "--kv-lora-rank", 1, ""),
    ("model", "--qk-head-dim", 1, ""),
    ("model", "--qk-pos-emb-head-dim", 1, ""),
    ("model", "--v-head-dim", 1, ""),
    ("train", "--micro-batch-size", 1, ""),
    ("train", "--global-batch-size", 1, ""),
    ("train", "--seq-length", 8, " (the synthetic data's shortest sequence is 8)"),
    ("train", "--vocab-size", 4, " (the synthetic data reserves token 0 for padding)"),
    ("train", "--train-iters", 1, ""),
    ("train", "--save-interval", 1, "; leave it out to save only at the end"),
    ("train", "--lr", 0, " (a negative rate climbs the loss)"),
    ("train", "--weight-decay", 0, ""),
    ("train", "--clip-grad", 0, " (0 turns clipping off; a negative value reverses the update)"),
    ("train", "--recompute-num-layers", 1, ""),
)


def _pattern(s: Settings) -> str | None:
    if not s.args.hybrid_layer_pattern:
        return PATTERN_REQUIRED
    s.parsed  # noqa: B018 - HybridPatternError (a ValueError) with a caret
    return None


#: Every rule, in the order they are checked (the first failing one is reported). Sizes come
#: first so the later rules may divide by them.
RULES: tuple[Rule, ...] = (
    rule("model", "--hybrid-layer-pattern", _pattern),
    *(_at_least(*row) for row in _MINIMUMS),
    *LORA_RULES,
    *MODEL_RULES,
    *DEVICE_RULES,
    *PARALLEL_RULES,
    *TRAIN_RULES,
    *DATA_RULES,
)


def validate_settings(
    args: TrainSettings,
    *,
    scopes: tuple[str, ...] = SCOPES,
    world_size: int | None = None,
    on_gpu: bool | None = None,
) -> None:
    """Check ``args`` against :data:`RULES` before anything is built.

    Args:
        args: the typed flags (:func:`~megatron_hybrid.training.train_settings.
            settings_from_args`).
        scopes: which rule scopes apply (``check-checkpoint`` checks only ``model``).
        world_size: processes of the job (default: ``WORLD_SIZE``, else 1).
        on_gpu: whether the run uses CUDA (default: whether CUDA is available).

    Raises:
        SettingsError: the first rule that fails, naming the flag and the fix.
        HybridPatternError: the pattern does not parse.
        TypeError: ``args`` is not :class:`TrainSettings` (a parsed namespace).
    """
    settings = Settings(
        require_settings(args, "validate_settings"),
        int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size,
        capabilities.on_gpu() if on_gpu is None else on_gpu,
    )
    for each in RULES:
        if each.scope in scopes:
            problem = each.problem(settings)
            if problem:
                raise SettingsError(problem)

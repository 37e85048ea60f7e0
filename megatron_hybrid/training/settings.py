"""What the flag rules check: the flags of one invocation and the rule record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from megatron_hybrid.pattern import ParsedPattern, parse_pattern
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = ["SCOPES", "Rule", "Settings", "SettingsError", "rule"]

SCOPES = ("model", "device", "parallel", "train")


class SettingsError(ValueError):
    """A flag (or combination) that cannot work; the message names the flag and the fix."""


@dataclass
class Settings:
    """The flags of one invocation plus what follows from them (pattern, world size, device).

    Attributes:
        args: the typed flags (rules read them as ``s.args.hidden_size``).
        world_size: processes of the job.
        on_gpu: whether the run uses CUDA.
    """

    args: TrainSettings
    world_size: int
    on_gpu: bool

    @cached_property
    def parsed(self) -> ParsedPattern:
        """The pattern, parsed once for every rule (the first rule checks that it is set)."""
        return parse_pattern(self.args.hybrid_layer_pattern)

    @property
    def counts(self) -> dict[str, int]:
        return self.parsed.layer_counts

    def has(self, symbol: str) -> bool:
        return bool(self.counts.get(symbol, 0))

    @property
    def tp(self) -> int:
        return self.args.tensor_model_parallel_size

    @property
    def etp(self) -> int:
        return self.args.expert_tensor_parallel_size or self.tp

    @property
    def head_dim(self) -> int:
        return self.args.kv_channels or self.args.hidden_size // self.args.num_attention_heads

    @property
    def data_parallel_size(self) -> int:
        a = self.args
        return self.world_size // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size
                                   * a.context_parallel_size)  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """One requirement: ``problem(settings)`` returns what is wrong and the fix, or None.

    Attributes:
        scope: ``model``, ``device``, ``parallel`` or ``train`` (see the module docstring).
        flags: the flags the rule is about (documentation and tests).
        problem: the check.
    """

    scope: str
    flags: tuple[str, ...]
    problem: Callable[[Settings], str | None]


def rule(scope: str, flags: str, problem: Callable[[Settings], str | None]) -> Rule:
    """A :class:`Rule` from a space-separated flag list."""
    return Rule(scope, tuple(flags.split()), problem)

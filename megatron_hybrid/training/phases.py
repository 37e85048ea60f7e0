"""Where a training step's time goes: phase timers that synchronise the device, when asked.

A step's phases are the data (building micro-batches: ``train`` builds the next step's inside a
step, once its work is queued, ``train_step``'s ``while_queued``), the forward and backward
passes, the gradient finalisation (megatron's ``finalize_model_grads``: the data-parallel
reduction and the division by the global token count, called at the end of the schedule), the
guard (the loss, the gradient norm and the check that both are finite), the optimizer (clipping,
the update, the copy back into the model's parameters). GPU work is asynchronous, so each phase
waits for the device at its start and end: the times are the phases' own, and whatever remains
of the step is host work between them (``host``).

The waits change what they measure (the host can no longer run ahead of the GPU), so timers are
off unless asked for: ``train_step(..., timer=None)`` (what ``train`` runs) adds no wait, and
``benchmarks/mfu.py`` times one extra step with a :class:`PhaseTimer`. Phases nest (the
finalisation runs inside the schedule): each keeps its own time, without its inner phases'.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

__all__ = ["HOST", "PHASES", "PhaseTimer", "phase"]

#: The phases a step reports.
PHASES = ("data", "forward-backward", "gradient finalisation", "guard", "optimizer")
#: The rest of the step: host work outside every phase.
HOST = "host"


class PhaseTimer:
    """Accumulates the exclusive time of named phases over the steps it times.

    Args:
        synchronize: waits for queued device work (``RuntimeBackend.synchronize``).
        clock: seconds, monotonic (``time.perf_counter``; tests pass their own).
    """

    def __init__(self, synchronize: Callable[[], None], clock: Callable[[], float] = None):
        self._synchronize = synchronize
        self._clock = clock or time.perf_counter
        self.totals: dict[str, float] = {}
        self.step_seconds = 0.0
        self.steps = 0
        self._stack: list[list] = []  # [name, seconds of inner phases]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` (its inner phases' time is theirs, not its own)."""
        self._synchronize()
        began = self._clock()
        self._stack.append([name, 0.0])
        try:
            yield
        finally:
            self._synchronize()
            elapsed = self._clock() - began
            _, inner = self._stack.pop()
            self.totals[name] = self.totals.get(name, 0.0) + elapsed - inner
            if self._stack:
                self._stack[-1][1] += elapsed

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one whole step; the phases inside it are parts of it."""
        self._synchronize()
        began = self._clock()
        try:
            yield
        finally:
            self._synchronize()
            self.step_seconds += self._clock() - began
            self.steps += 1

    def wrap(self, name: str, function: Callable) -> Callable:
        """``function`` timed as phase ``name`` whenever it is called."""

        @functools.wraps(function)
        def timed(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        return timed

    def breakdown(self) -> dict[str, float]:
        """Seconds per step of every phase seen, then :data:`HOST` (the step's remainder); the
        values sum to the mean step time."""
        steps = max(self.steps, 1)
        known = [name for name in PHASES if name in self.totals]
        names = known + sorted(set(self.totals) - set(known))
        out = {name: self.totals[name] / steps for name in names}
        out[HOST] = (self.step_seconds - sum(self.totals.values())) / steps
        return out


def phase(timer: PhaseTimer | None, name: str):
    """``timer.phase(name)``, or nothing (no wait) without a timer."""
    return contextlib.nullcontext() if timer is None else timer.phase(name)

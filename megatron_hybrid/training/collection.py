"""``--manual-gc``: Python's garbage collector between training steps instead of inside them.

Python's automatic collector runs whenever container allocations outnumber deallocations by its
threshold, which in a training step means in the middle of a forward or backward pass, and now
and then it walks every tracked object of the process (a model's modules, parameters, hooks).
A step on one GPU is host-bound (``docs/performance.md``), so that time is the step's; over data
parallelism the ranks collect at different moments and wait for each other. Megatron-LM's
``--manual-gc`` (``megatron/training/training.py``, ``train``) turns automatic collection off
for the run, collects every ``--manual-gc-interval`` iterations and before and after each
evaluation (``--no-manual-gc-eval``: not there). The flags here mean the same.
"""

from __future__ import annotations

import gc

__all__ = ["ManualCollection"]


class ManualCollection:
    """The collector's schedule over a run: a context manager around the training loop.

    Args:
        enabled: ``--manual-gc``; False leaves Python's automatic collection as it is and makes
            every method a no-op.
        interval: ``--manual-gc-interval``: collect after every ``interval``-th iteration
            (0: never between steps).
        around_eval: ``--manual-gc-eval``: a full collection before each evaluation and a
            young-generation one after it (Megatron-LM's choice: what the evaluation made).
    """

    def __init__(self, enabled: bool, interval: int = 0, around_eval: bool = True):
        if interval < 0:
            raise ValueError(f"--manual-gc-interval {interval} must be >= 0")
        self.enabled, self.interval, self.around_eval = enabled, interval, around_eval
        self.collections = 0
        self._was_enabled = True

    def __enter__(self) -> ManualCollection:
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()
        return self

    def __exit__(self, *exc) -> None:
        # Restore the collector as found: run_training also runs inside other programs.
        if self.enabled and self._was_enabled:
            gc.enable()

    def _collect(self, generation: int = 2) -> None:
        gc.collect(generation)
        self.collections += 1

    def after_step(self, done: int) -> None:
        """After iteration ``done`` (counted from 1): a full collection on the interval."""
        if self.enabled and self.interval and done % self.interval == 0:
            self._collect()

    def before_eval(self) -> None:
        if self.enabled and self.around_eval:
            self._collect()

    def after_eval(self) -> None:
        if self.enabled and self.around_eval:
            self._collect(generation=0)

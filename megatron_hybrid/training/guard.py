"""What a run does after a step whose loss or gradient was NaN or infinite.

``train_step`` never applies such a step (it checks the loss and every gradient on every rank
before the optimizer runs) and names the first NaN or infinite parameter or gradient it finds.
``--on-nonfinite stop`` (the default) then ends the run with one message naming it and exit
code 2, before anything else is saved; ``--on-nonfinite skip`` drops the step and goes on with
the next batch, as Megatron-LM skips an iteration whose gradients overflowed. Either way no
checkpoint holds a non-finite tensor (the checkpoint store refuses one by name too).
"""

from __future__ import annotations

__all__ = ["NONFINITE_POLICIES", "NonFiniteStepError", "check_step", "describe"]

#: Values of ``--on-nonfinite``.
NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteStepError(ValueError):
    """A step's loss or gradient was NaN or infinite and the policy is ``stop``."""


def check_step(result, iteration: int, policy: str, last_saved: str | None) -> bool:
    """Apply the policy to one step's result.

    Args:
        result: the step's ``StepResult``.
        iteration: the step's 1-based number.
        policy: ``"stop"`` or ``"skip"``.
        last_saved: the newest checkpoint this run wrote, to name in the message.

    Returns:
        True if the step was skipped (non-finite, policy ``skip``), False if it was finite.

    Raises:
        NonFiniteStepError: non-finite and policy ``stop``.
    """
    if result.finite:
        return False
    if policy == "skip":
        return True
    where = f"; the newest checkpoint of this run is {last_saved}" if last_saved else ""
    raise NonFiniteStepError(
        f"step {iteration}: {describe(result)}; stopped without applying or saving it{where}. "
        "Lower --lr, check the data and the --load checkpoint, or pass --on-nonfinite skip to "
        "drop such steps"
    )


def describe(result) -> str:
    """What was NaN or infinite in a step, first found first (for the run's messages)."""
    what = result.nonfinite or "the loss or a gradient"
    return (
        f"{what} is NaN or infinite (loss {result.loss:.4g}, gradient norm "
        f"{result.grad_norm:.4g})"
    )

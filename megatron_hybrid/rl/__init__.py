"""The RL trainer's API: a policy-gradient step on packed sequences, log-probs, weight sync and a
small sampler, over the models :func:`~megatron_hybrid.hf.load_hf_model` builds.

* :class:`PolicyTrainer` (``rl/trainer.py``): ``step`` (one optimizer step on the clipped
  policy loss with KL and entropy terms, through megatron-core's schedule and DDP),
  ``logprobs`` and ``iter_hf_weights``;
* the loss itself as pure tensor math (``rl/losses.py``), and the forward step and loss function
  megatron-core's schedule calls (``rl/forward_step.py``);
* :func:`sample` (``rl/sampler.py``): greedy / temperature / top-p sampling for examples, tests
  and engine-free runs (weight sync into its model: ``load_hf_weights(model,
  dict(trainer.iter_hf_weights()))``).

``docs/user_guide.md``, "Use it from an RL framework", has the ten-line loop. Importing this
package loads no torch; the names load it on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LOSS_AGGREGATIONS": "losses",
    "PolicyLoss": "losses",
    "PolicyTrainer": "trainer",
    "StepMetrics": "trainer",
    "TrainerSettings": "trainer",
    "sample": "sampler",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

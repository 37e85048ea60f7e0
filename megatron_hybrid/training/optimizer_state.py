"""The CPU optimizer's state as sharded tensors, so that a resume may change the parallel layout.

AdamW keeps two tensors per parameter (``exp_avg``, ``exp_avg_sq``) of the parameter's shape and
a step count. Each moment is stored like the parameter it belongs to: the parameter's
``ShardedTensor`` (or factory) with the key ``optimizer.state.<name>.<parameter key>`` and the
same global shape, offsets and replica ids, as megatron-core's own non-distributed optimizers
store theirs (``dist_checkpointing/optimizer.py``: ``make_sharded_optimizer_tensor``). So
``dist_checkpointing`` reshards the optimizer state exactly as it reshards the model: over TP,
PP, EP and DP. The step, equal for every parameter, is part of the common state; learning rate
and weight decay come from the flags of the run that loads.

Checkpoints of the older per-rank format (``checkpointing.store.PER_RANK_FORMAT``) hold one
pickled AdamW state per rank instead; they load only into the layout that wrote them
(``load_checkpoint`` says so when they do not).
"""

from __future__ import annotations

import torch

__all__ = [
    "LayoutChangeError",
    "check_layout",
    "cpu_optimizer_sharded_state",
    "load_cpu_optimizer_state",
]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class LayoutChangeError(ValueError):
    """The checkpoint cannot be resumed on this parallel layout; the message says why."""


def cpu_optimizer_sharded_state(optimizer, model_state: dict, *, loading: bool) -> dict:
    """The sharded state dict of a ``CPUOptimizer`` (zeros as the load template).

    Args:
        optimizer: the ``CPUOptimizer``.
        model_state: the model's sharded state dict (``{"model": ...}`` or per chunk), whose
            entries hold the parameters themselves.
        loading: build a template to load into instead of the state to save.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    by_index = get_param_id_to_sharded_param_map(model_state, optimizer.params)
    unmapped = [i for i in range(len(optimizer.params)) if i not in by_index]
    assert not unmapped, f"parameters {unmapped} have no checkpoint key"  # the model's contract
    state = optimizer.optimizer.state
    steps = {float(state[p]["step"]) for p in optimizer.params if "step" in state.get(p, {})}
    assert len(steps) <= 1, f"AdamW steps differ between parameters: {sorted(steps)}"
    moments = {}
    for i, param in enumerate(optimizer.params):
        saved = state.get(param, {})
        for name in _MOMENTS:
            value = saved.get(name) if not loading else None
            moments[f"{name}.{i}"] = make_sharded_optimizer_tensor(
                by_index[i],
                value if value is not None else torch.zeros_like(param),
                prefix=f"optimizer.state.{name}",
            )
    return {"moments": moments, "step": None if loading else (steps.pop() if steps else 0.0)}


def load_cpu_optimizer_state(optimizer, loaded: dict) -> None:
    """Put loaded moments and step into the ``CPUOptimizer``'s AdamW."""
    inner = optimizer.optimizer
    step = float(loaded["step"])
    state = {
        i: {
            # One tensor per parameter: torch's AdamW increments each step in place.
            "step": torch.tensor(step),
            **{name: loaded["moments"][f"{name}.{i}"] for name in _MOMENTS},
        }
        for i in range(len(optimizer.params))
    }
    if step:
        inner.load_state_dict({"state": state, "param_groups": inner.state_dict()["param_groups"]})


def check_layout(common: dict, folder, layout: dict | None, *, cpu_optimizer: bool) -> bool:
    """Refuse, before loading, a layout change the checkpoint cannot follow.

    Args:
        common: the checkpoint's common state.
        folder: the checkpoint folder (for messages).
        layout: this run's parallel sizes (``tp``, ``pp``, ``ep``, ``dp``), if known.
        cpu_optimizer: whether the run uses the CPU optimizer.

    Returns:
        True if the checkpoint was written by as many processes as run now, so that its
        per-rank RNG state loads.

    Raises:
        LayoutChangeError: the GPU optimizer's ``dp_reshardable`` state saved with other
            TP/PP/EP/CP/ETP sizes.
    """
    world = torch.distributed.get_world_size()
    saved_world = common.get("world_size")
    saved_layout = common.get("parallel_layout")
    if not cpu_optimizer and saved_layout is not None and layout is not None:
        fixed = ("tp", "pp", "ep", "cp", "etp")
        if any(saved_layout.get(k) != layout.get(k) for k in fixed):
            raise LayoutChangeError(
                f"{folder} was saved with {saved_layout}, this run has {layout}: megatron-core's "
                "distributed-optimizer state (dp_reshardable format) reshards only over data "
                "parallelism; keep TP, PP and EP, or load the model weights alone"
            )
    return saved_world is None or saved_world == world

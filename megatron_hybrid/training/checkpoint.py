"""Save and resume training state as ``torch_dist`` checkpoints in Megatron-LM's layout.

``<root>/iter_0000010/`` holds one dist checkpoint with the model chunks (``model`` or
``model0``, ``model1``, ... for virtual stages, as Megatron-LM names them), the optimizer state,
every rank's RNG state and the iteration; ``<root>/latest_checkpointed_iteration.txt`` names the
newest. Model tensors use the package's checkpoint keys, so a grouped pattern's checkpoint is a
GPTModel checkpoint (``check-checkpoint`` reads either).

Nothing is written over an existing iteration folder unless ``overwrite`` is set, nothing is
saved from parameters that are not finite, and every save ends with an integrity manifest
(``integrity.json``: SHA-256 of every file) written before the tracker names the folder.
"""

from __future__ import annotations

import os
import queue
import random
from pathlib import Path

import numpy as np
import torch

from megatron_hybrid.checkpointing.inspect import TRACKER_FILE, iteration_folder_name

__all__ = [
    "CheckpointExistsError",
    "NonFiniteCheckpointError",
    "consumed_samples",
    "existing_iterations",
    "load_checkpoint",
    "save_checkpoint",
]

_FORMAT = "megatron_hybrid/2"  # /1: per-rank CPU optimizer state


class CheckpointExistsError(FileExistsError):
    """The iteration folder already exists and overwriting was not asked for."""


class NonFiniteCheckpointError(ValueError):
    """A parameter is NaN or infinite: such a state is never saved."""


def existing_iterations(root) -> list[int]:
    """Iterations that already have a folder under ``root``."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        int(p.name[len("iter_") :])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("iter_") and p.name[len("iter_") :].isdigit()
    )


def _unwrapped(chunks) -> list:
    # DistributedDataParallel has no sharded_state_dict of its own: megatron's default one would
    # prefix every key with "module." (not Megatron-LM's layout, invisible to check-checkpoint),
    # and its load_state_dict hands the module keys it does not have. Megatron-LM unwraps too.
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(chunks))


def _model_state(chunks, metadata):
    from megatron_hybrid.checkpointing.sharded import model_sharded_state

    return model_sharded_state(_unwrapped(chunks), metadata)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _per_rank_object(key: str, value):
    """A value every rank keeps its own copy of (RNG state, CPU optimizer state)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject(key, value, (world,), (rank,), replica_id=0)


def _optimizer_state(optimizer, model_state, *, loading: bool, per_rank: bool = False):
    from megatron_hybrid.training.loop import CPUOptimizer
    from megatron_hybrid.training.optimizer_state import cpu_optimizer_sharded_state

    if isinstance(optimizer, CPUOptimizer):
        if per_rank:  # format megatron_hybrid/1: one pickled AdamW state per rank
            return _per_rank_object("optimizer.cpu_adamw", None)
        return cpu_optimizer_sharded_state(optimizer, model_state, loading=loading)
    merged = {}
    for value in model_state.values():
        merged.update(value)
    # Megatron-LM's default layout for the distributed optimizer's state (reshardable over DP).
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
    return optimizer.sharded_state_dict(merged, is_loading=loading, metadata=metadata)


def _parameters_finite(chunks, device) -> bool:
    flags = [torch.isfinite(p).all() for chunk in _unwrapped(chunks) for p in chunk.parameters()]
    finite = torch.stack(flags).all() if flags else torch.tensor(True)
    bad = (~finite).float().reshape(1).to(device)
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())


def _in_process_write_results() -> None:
    """Keep megatron-core's synchronous save inside this process (no helper processes).

    megatron-core 0.19.2's ``FileSystemWriterAsync`` (``dist_checkpointing/strategies/
    filesystem_async.py``) hands write results over a queue that it creates on first use with a
    ``spawn`` multiprocessing ``Manager``: a server process, plus spawn's resource tracker, that
    outlive a killed trainer (re-parented to PID 1). A synchronous save writes with threads of
    this process and reads the results back in it, so an in-process queue carries them.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(
    root,
    iteration: int,
    chunks,
    optimizer,
    *,
    pattern: str,
    overwrite=False,
    consumed_samples: int | None = None,
    layout: dict | None = None,
):
    """Save a step's state under ``root``; return the iteration folder.

    Args:
        consumed_samples: training samples used so far (a resume continues from it).
        layout: parallel sizes (``tp``, ``pp``, ``ep``, ``dp``), recorded so that a resume can
            tell before training whether it may change them.

    Raises:
        CheckpointExistsError: the folder exists and ``overwrite`` is False.
        NonFiniteCheckpointError: a parameter is NaN or infinite (nothing is written).
    """
    from megatron.core import dist_checkpointing

    from megatron_hybrid.checkpointing.integrity import INTEGRITY_FILE, write_integrity_manifest

    root = Path(root)
    folder = root / iteration_folder_name(iteration)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if not _parameters_finite(chunks, device):
        raise NonFiniteCheckpointError(
            f"not saving iteration {iteration} to {folder}: the model has NaN or infinite "
            "parameters"
        )
    exists = torch.tensor([int(folder.exists())], device=device)
    torch.distributed.all_reduce(exists)  # every rank must agree before anyone writes
    if exists.item() and not overwrite:
        raise CheckpointExistsError(
            f"{folder} already exists; pass --overwrite-checkpoint to replace it or choose "
            "another --save directory"
        )
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        # Replacing a checkpoint: until the new one is complete, the folder must not look
        # complete (or verified), so that a kill midway leaves a leftover, not a bad checkpoint.
        for marker in ("metadata.json", INTEGRITY_FILE):
            (folder / marker).unlink(missing_ok=True)
    torch.distributed.barrier()
    model = _model_state(chunks, metadata=None)
    state = {
        **model,
        "optimizer": _optimizer_state(optimizer, model, loading=False),
        "rng_state": _per_rank_object("rng_state", _rng_state()),
        "iteration": iteration,
        "megatron_hybrid": {
            "format": _FORMAT,
            "hybrid_layer_pattern": pattern,
        },
    }
    if consumed_samples is not None:
        state["consumed_samples"] = consumed_samples
    state["world_size"] = torch.distributed.get_world_size()
    if layout is not None:
        state["parallel_layout"] = dict(layout)
    _in_process_write_results()
    dist_checkpointing.save(state, str(folder))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        from megatron_hybrid.hf.dist import hf_record, hf_record_tensors, write_hf_record

        # A model started from Hugging Face weights: which one, so that the checkpoint resumes
        # without model flags and exports with convert --to-hf (its FP8 format and carried
        # tensors included).
        write_hf_record(folder, hf_record(chunks), tensors=hf_record_tensors(chunks))
        write_integrity_manifest(folder)
        tmp = root / f".{TRACKER_FILE}.tmp"
        tmp.write_text(str(iteration))
        os.replace(tmp, root / TRACKER_FILE)  # atomic: a crash never leaves a half-written tracker
    torch.distributed.barrier()
    return folder


def _materialize_optimizer_state(optimizer) -> None:
    """Give megatron's distributed optimizer state before the first step, so it can be loaded.

    Without apex or TransformerEngine, ``DistributedOptimizer.state_dict`` reads the Adam step
    from the torch optimizer's state, which is empty until the first update; megatron's own
    dummy-state initialisation fills it (the values are then replaced by the loaded ones).
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if (
            inner is not None
            and not inner.state
            and hasattr(sub, "_init_optimizer_states_with_dummy_values")
        ):
            sub._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter its own, correct Adam ``step`` after a distributed-optimizer load.

    Without apex or TransformerEngine, megatron-core 0.19.2's ``DistributedOptimizer`` keeps the
    step in torch's per-parameter state, and its ``load_state_dict`` leaves every parameter
    sharing one ``step`` tensor which the ``dp_reshardable`` parameter-state load then overwrites
    with a wrong value (1 after a 4-step run). torch's Adam increments each state's step in place,
    so a shared tensor would also advance once per parameter per update. Either way the bias
    correction after a resume differs from an uninterrupted run. The step saved with the param
    groups is right: copy it into a fresh tensor per parameter.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    old = state["step"]
                    state["step"] = torch.tensor(
                        float(group["step"]), dtype=old.dtype, device=old.device
                    )


def load_checkpoint(root, chunks, optimizer, *, layout: dict | None = None) -> int:
    """Restore model, optimizer and RNG state from the newest checkpoint under ``root``.

    Model and optimizer state reshard to this run's parallel layout (on GPUs only over data
    parallelism: megatron's ``dp_reshardable`` format). The per-rank RNG state is restored only
    when as many processes run as saved it (a new layout starts from the seeded RNG).

    Args:
        layout: this run's parallel sizes (see :func:`save_checkpoint`).

    Returns:
        The iteration the checkpoint was saved at.

    Raises:
        LayoutChangeError: the checkpoint cannot be resumed on this layout (before any load).
        CheckpointDamagedError: a file cannot be read.
    """
    from megatron.core import dist_checkpointing

    from megatron_hybrid.checkpointing.inspect import resolve_checkpoint_dir
    from megatron_hybrid.training.loop import CPUOptimizer
    from megatron_hybrid.training.optimizer_state import (
        PER_RANK_FORMAT,
        check_layout,
        load_cpu_optimizer_state,
    )

    folder = resolve_checkpoint_dir(root)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    cpu = isinstance(optimizer, CPUOptimizer)
    same_world = check_layout(common, folder, layout, cpu_optimizer=cpu)
    per_rank = (common.get("megatron_hybrid") or {}).get("format") == PER_RANK_FORMAT
    _materialize_optimizer_state(optimizer)
    model = _model_state(chunks, metadata=None)
    request = {**model, "optimizer": _optimizer_state(optimizer, model, loading=True,
                                                      per_rank=per_rank)}  # fmt: skip
    if same_world:
        request["rng_state"] = _per_rank_object("rng_state", None)
    try:
        state = dist_checkpointing.load(request, str(folder))
    except BaseException as error:  # noqa: BLE001 - torch's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        from megatron_hybrid.checkpointing.integrity import (
            CheckpointDamagedError,
            describe_read_error,
        )
        from megatron_hybrid.training.optimizer_state import LayoutChangeError

        if per_rank and cpu:
            raise LayoutChangeError(
                f"{folder} holds the CPU optimizer state per rank ({PER_RANK_FORMAT}) and does "
                f"not load here ({describe_read_error(error)}): resume it with the number of "
                "processes and the parallel layout that wrote it"
            ) from None
        raise CheckpointDamagedError(
            f"cannot read the checkpoint {folder}: {describe_read_error(error)}"
        ) from None
    for i, chunk in enumerate(_unwrapped(chunks)):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    # fp32 models: the distributed optimizer's main params are views of the parameters.
    with torch.no_grad():
        if cpu and not per_rank:
            load_cpu_optimizer_state(optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(optimizer)
    if same_world:
        _set_rng_state(state["rng_state"])
    return int(common.get("iteration", state.get("iteration", 0)))


def consumed_samples(folder) -> int | None:
    """Training samples a checkpoint's run had used (None: saved before this was recorded)."""
    from megatron.core import dist_checkpointing

    value = dist_checkpointing.load_common_state_dict(str(folder)).get("consumed_samples")
    return None if value is None else int(value)

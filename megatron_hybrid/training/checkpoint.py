"""Save and resume training state as ``torch_dist`` checkpoints in Megatron-LM's layout.

``<root>/iter_0000010/`` holds one dist checkpoint with the model chunks (``model`` or
``model0``, ``model1``, ... for virtual stages, as Megatron-LM names them; for a LoRA run the
adapters only, with the record of their base), the optimizer state,
every rank's RNG state and the iteration; ``<root>/latest_checkpointed_iteration.txt`` names the
newest. Model tensors use the package's checkpoint keys, so a grouped pattern's checkpoint is a
GPTModel checkpoint (``check-checkpoint`` reads either).

The folder itself is the checkpoint store's (``checkpointing/store.py``): it refuses NaN and
infinite tensors by name, never writes over an existing iteration folder unless ``overwrite`` is
set, writes the folder beside its place and moves it in complete, with its integrity manifest,
before the tracker names it. The common record names the run (``training/save_target.py``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch

from megatron_hybrid.checkpointing import store
from megatron_hybrid.checkpointing.sharded import model_sharded_state
from megatron_hybrid.checkpointing.store import (
    COMMON_RECORD,
    HF_RECORD_FILE,
    PER_RANK_FORMAT,
    TRAIN_FORMAT,
    CheckpointExistsError,
    NonFiniteCheckpointError,
)
from megatron_hybrid.hf.dist import HF_SOURCE_KEY, carried_files, hf_record, hf_source_state
from megatron_hybrid.peft.apply import lora_state
from megatron_hybrid.peft.checkpoint import (
    LORA_RECORD,
    load_adapter_state,
    lora_record,
    lora_sharded_state,
)
from megatron_hybrid.training.optimizer_state import (
    LayoutChangeError,
    check_layout,
    cpu_optimizer_sharded_state,
    load_cpu_optimizer_state,
)
from megatron_hybrid.training.optimizers import CPUOptimizer
from megatron_hybrid.training.param_order import COMMON_KEY as PARAM_ORDER_KEY
from megatron_hybrid.training.param_order import check_order, chunk_order
from megatron_hybrid.training.save_target import RUN_KEY

__all__ = [
    "REAL_VOCAB_SIZE",
    "CheckpointExistsError",
    "NonFiniteCheckpointError",
    "apply_recorded_vocab",
    "consumed_samples",
    "load_checkpoint",
    "save_checkpoint",
]

#: Entry of the common record with the model's real (tokenizer's) vocabulary size, which
#: differs from the embedding's rows when the vocabulary is padded (Megatron-LM's models).
REAL_VOCAB_SIZE = "real_vocab_size"


def _unwrapped(chunks) -> list:
    # DistributedDataParallel has no sharded_state_dict of its own: megatron's default one would
    # prefix every key with "module." (not Megatron-LM's layout, invisible to check-checkpoint),
    # and its load_state_dict hands the module keys it does not have. Megatron-LM unwraps too.
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(chunks))


def _adapted(chunks) -> bool:
    return lora_state(_unwrapped(chunks)) is not None


def _model_state(chunks, metadata):
    """The model part of a checkpoint: the weights, or a LoRA run's adapters only (keyed like
    the weights they adapt, so they reshard as the base does)."""
    if _adapted(chunks):
        return lora_sharded_state(_unwrapped(chunks), metadata)
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
    model_settings: Mapping | None = None,
    records: Mapping[str, Mapping] | None = None,
    run: str | None = None,
    replace_root: bool = False,
    common: Mapping | None = None,
):
    """Save a step's state under ``root`` through the checkpoint store; return the folder.

    Args:
        pattern: the model's layer pattern (recorded).
        consumed_samples: training samples used so far (a resume continues from it).
        layout: parallel sizes (``tp``, ``pp``, ``ep``, ``dp``), recorded so that a resume can
            tell before training whether it may change them.
        model_settings: the model's settings (flag dest -> value), recorded so that
            ``check-checkpoint`` needs no flags.
        records: further JSON records (file name -> object) for the folder; a model started
            from Hugging Face weights gets its :data:`~megatron_hybrid.checkpointing.store.
            HF_RECORD_FILE` and the source's tokenizer files (``hf_files/``) without asking.
        run: the run's identity (recorded; see ``training/save_target.py``).
        replace_root: the checkpoint replaces everything ``root`` holds (the store's
            ``replace_root``; with ``overwrite``).
        common: further non-tensor values of the run (the learning-rate schedule's state, the
            data it reads), kept in the checkpoint's common state under their keys.

    Raises:
        CheckpointExistsError: the folder exists and ``overwrite`` is False.
        NonFiniteCheckpointError: a tensor is NaN or infinite (named; nothing is written).
    """
    model = _model_state(chunks, metadata=None)
    record = {"format": TRAIN_FORMAT, "hybrid_layer_pattern": pattern}
    if model_settings is not None:
        record["model"] = dict(model_settings)
    if run is not None:
        record[RUN_KEY] = run
    real = getattr(_unwrapped(chunks)[0], "real_vocab_size", None)
    if real is not None:  # the tokenizer's vocabulary, where the output layer is padded
        record[REAL_VOCAB_SIZE] = int(real)
    state = {
        **model,
        "optimizer": _optimizer_state(optimizer, model, loading=False),
        "rng_state": _per_rank_object("rng_state", _rng_state()),
        "iteration": iteration,
        COMMON_RECORD: record,
        "world_size": torch.distributed.get_world_size(),
        # The buffer order the distributed optimizer's dp_reshardable state is laid out in.
        PARAM_ORDER_KEY: chunk_order(chunks),
    }
    if consumed_samples is not None:
        state["consumed_samples"] = consumed_samples
    if layout is not None:
        state["parallel_layout"] = dict(layout)
    state.update(common or {})
    # A model started from Hugging Face weights: which one, so that the checkpoint resumes
    # without model flags and exports with convert --to-hf (its FP8 scales and carried tensors
    # travel in the state, outside the model's keys).
    from_hf = hf_record(_unwrapped(chunks))
    if from_hf:
        state[HF_SOURCE_KEY] = hf_source_state(_unwrapped(chunks))
    all_records = {**({HF_RECORD_FILE: from_hf} if from_hf else {}), **(records or {})}
    files = carried_files(_unwrapped(chunks)) if from_hf else {}
    if _adapted(chunks):
        # The adapters' config, and where their base came from with its fingerprint: a resume
        # or export needs nothing else and refuses another base.
        base = lora_state(_unwrapped(chunks)).base_info or {}
        all_records[LORA_RECORD] = lora_record(_unwrapped(chunks), base=base)
    return store.write(
        root,
        iteration,
        state,
        all_records,
        files=files,
        overwrite=overwrite,
        replace_root=replace_root,
    )


def apply_recorded_vocab(chunks, folder) -> int | None:
    """Give the model chunks the real vocabulary ``folder``'s common record holds (None: it
    records none); log-probs then leave the padding rows out (``forward_logprobs``).

    Raises:
        ValueError: the record's vocabulary exceeds the model's rows (another model).
    """
    real = store.common_record(store.read_common(folder)).get(REAL_VOCAB_SIZE)
    if real is None:
        return None
    for chunk in _unwrapped(chunks):
        if real > chunk.vocab_size:
            raise ValueError(
                f"{folder} records a vocabulary of {real} tokens, more than the model's "
                f"{chunk.vocab_size} rows: it holds another model"
            )
        chunk.real_vocab_size = real
    return real


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
        OrderMismatchError: its distributed-optimizer state was laid out in another buffer
            order than ``chunks`` (``training/param_order.py``; before any load).
        CheckpointDamagedError: a file cannot be read.
    """
    folder = store.resolve_checkpoint_dir(root)
    common = store.read_common(folder)
    cpu = isinstance(optimizer, CPUOptimizer)
    same_world = check_layout(common, folder, layout, cpu_optimizer=cpu)
    check_order(common, folder, chunks)
    per_rank = store.common_record(common).get("format") == PER_RANK_FORMAT
    _materialize_optimizer_state(optimizer)
    model = _model_state(chunks, metadata=None)
    request = {**model, "optimizer": _optimizer_state(optimizer, model, loading=True,
                                                      per_rank=per_rank)}  # fmt: skip
    if same_world:
        request["rng_state"] = _per_rank_object("rng_state", None)
    try:
        state = store.read(folder, request)
    except store.CheckpointDamagedError as error:
        if per_rank and cpu:
            raise LayoutChangeError(
                f"{folder} holds the CPU optimizer state per rank ({PER_RANK_FORMAT}) and does "
                f"not load here ({error}): resume it with the number of processes and the "
                "parallel layout that wrote it"
            ) from None
        raise
    if _adapted(chunks):
        load_adapter_state(_unwrapped(chunks), state)
    else:
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
    value = store.read_common(folder).get("consumed_samples")
    return None if value is None else int(value)

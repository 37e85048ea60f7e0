"""The public entry points in: build a model from a Hugging Face folder and check a conversion
before copying anything (writing one back: :mod:`megatron_hybrid.hf.export`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from megatron_hybrid.hf.config import (
    HANDLED_FIELDS,
    HFConfigError,
    HFConversion,
    conversion_for,
    convert_config,
    family_named,
)
from megatron_hybrid.hf.fp8 import (
    DequantizingReader,
)
from megatron_hybrid.hf.io import (
    HFCheckpoint,
)
from megatron_hybrid.hf.plan import Plan, PlanReport, build_plan, check_plan
from megatron_hybrid.hf.weights import (
    SHARDED_METADATA,
    carried_names,
    load_hf_weights,
)
from megatron_hybrid.model import HybridModel, expected_checkpoint_tensors
from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.modules.mamba_torch import with_mixer_params
from megatron_hybrid.pattern import MAMBA, MOE, PIPE, virtual_stages, with_stages
from megatron_hybrid.process_groups import init_world, initialize_model_parallel
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.schedule.p2p import pipeline_p2p_fields

__all__ = [
    "ConversionCheck",
    "ParallelSizes",
    "check_conversion",
    "dry_run",
    "expected_key_shapes",
    "load_hf_model",
]


def expected_key_shapes(
    conversion: HFConversion, backend: str = "local", metadata: dict | None = None
) -> dict:
    """Checkpoint key -> global shape of the conversion's model (built on the meta device).

    Args:
        conversion: the conversion.
        backend: ``"local"`` or ``"te"`` (the key names differ).
        metadata: sharded-state-dict metadata (default: the indexed form conversion uses).
    """
    runtime = select_backend()
    runtime.activate()  # the meta-device build calls megatron's CUDA-only functions
    config = conversion.transformer_config(**runtime.config_overrides(), params_dtype=torch.float32)
    kwargs = dict(conversion.model_kwargs)
    vocab, length = kwargs.pop("vocab_size"), kwargs.pop("max_sequence_length")
    return expected_checkpoint_tensors(
        config,
        conversion.pattern.pattern,
        vocab_size=vocab,
        max_sequence_length=length,
        backend=backend,
        metadata=dict(SHARDED_METADATA if metadata is None else metadata),
        **kwargs,
    )


@dataclass
class ConversionCheck:
    """A Hugging Face folder opened, its config converted and its weights planned, once.

    Attributes:
        source: the open folder.
        conversion: the conversion (None when the config is refused).
        plan: the weight plan over the whole model (None when the config is refused).
        report: what :func:`dry_run` reports (``report.ok``: nothing to fix).
    """

    source: HFCheckpoint
    conversion: HFConversion | None
    plan: Plan | None
    report: PlanReport


def check_conversion(
    path, *, backend: str = "local", mtp: bool | None = None, ignore_config_fields=()
) -> ConversionCheck:
    """Open a folder, convert its config and plan its weights, before anything is copied.

    Builds the model the folder describes on the meta device (no memory) and lists unsupported
    config fields, model tensors without a source, Hugging Face tensors the model would not use
    and shape mismatches; its notes say how many block-scaled FP8 weights load dequantized and
    which tensors of declared parts (a multimodal checkpoint's vision tower) are carried
    through untouched. Pass the result's ``source``, ``conversion`` and ``plan`` to
    :func:`load_hf_model` to load without doing any of it again.

    Raises:
        HFCheckpointError, HFConfigError: the folder or its config is damaged (one message),
            or its FP8 tensors are inconsistent (a weight without its scale, a scale of the
            wrong shape, ...).
    """
    source = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    report = PlanReport()
    try:
        conversion = conversion_for(source, mtp=mtp, ignore_config_fields=ignore_config_fields)
    except HFConfigError:
        conversion = convert_config(source.config, mtp=mtp, has_tensor=lambda n: n in source)
        ignored = set(ignore_config_fields) - HANDLED_FIELDS
        report.unsupported_config = [(k, m) for k, m in conversion.unsupported if k not in ignored]
        return ConversionCheck(source, None, None, report)
    plan, unresolved = build_plan(conversion, expected_key_shapes(conversion, backend))
    carried = carried_names(source, conversion)
    reader = DequantizingReader(source, conversion.quantization, skip=carried)
    info = {name: reader.info(name) for name in reader.names()}
    checked = check_plan(plan, unresolved, info)
    checked.missing_hf = [n for n in checked.missing_hf if n not in plan.shared_copies]
    if conversion.quantization is not None:
        count = sum(1 for name in plan.hf_shapes if name in reader.scales)
        checked.notes.append(f"{conversion.quantization.describe()}: {count} tensors dequantized")
    checked.carried = carried
    checked.notes += _carried_notes(conversion, carried)
    return ConversionCheck(source, conversion, plan, checked)


def dry_run(path, *, backend: str = "local", mtp: bool | None = None, ignore_config_fields=()):
    """Check a conversion before anything is copied (:func:`check_conversion`'s verdict).

    Returns:
        ``(conversion or None, PlanReport)``; the conversion is None when the config is refused.
    """
    check = check_conversion(
        path, backend=backend, mtp=mtp, ignore_config_fields=ignore_config_fields
    )
    return check.conversion, check.report


def _carried_notes(conversion: HFConversion, carried) -> list[str]:
    family = family_named(conversion.family)
    notes = []
    for key, prefix in family.carried_parts:
        count = sum(1 for name in carried if name.startswith(prefix))
        if count:
            notes.append(
                f"carried through untouched: {count} tensors under {prefix}* ({key}; the hybrid "
                "model does not compute them)"
            )
    return notes


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel layout :func:`load_hf_model` builds a model for (``train``'s sizes).

    Attributes:
        tp, pp, ep, cp: tensor, pipeline, expert and context parallel sizes.
        vpp: virtual pipeline stages per pipeline rank (None: no interleaving).
        etp: expert tensor parallel size (None: the tensor parallel size).
        sequence_parallel: None: on whenever TP is (megatron-core needs it for MoE under TP).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: int | None = None
    etp: int | None = None
    sequence_parallel: bool | None = None

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is on."""
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def unsupported(self, transformer_impl: str, has_experts: bool) -> str | None:
        """What this layout cannot do, by the name of the argument that asks for it (or None)."""
        names = dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                     expert_model_parallel_size=self.ep, context_parallel_size=self.cp)  # fmt: skip
        if self.etp is not None:
            names["expert_tensor_parallel_size"] = self.etp
        if self.vpp is not None:
            names["virtual_pipeline_model_parallel_size"] = self.vpp
        for name, value in names.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"{name} must be an int >= 1, got {value!r}"
        if self.sequence_parallel and self.tp == 1:
            return "sequence_parallel=True needs tensor_model_parallel_size > 1"
        if self.sequence_parallel is False and self.tp > 1 and has_experts:
            return (
                "sequence_parallel=False with tensor_model_parallel_size > 1: megatron-core runs "
                "MoE layers under tensor parallelism only with sequence parallelism; leave it on"
            )
        if self.vpp is not None and self.pp == 1:
            return (
                "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1 "
                "(virtual stages interleave pipeline ranks)"
            )
        if self.cp > 1 and transformer_impl != "transformer_engine":
            return (
                f"context_parallel_size={self.cp} needs transformer_impl='transformer_engine': the "
                "local backend's attention, GatedDeltaNet and Mamba layers have no context "
                "parallelism (train's --context-parallel-size rule)"
            )
        return None


def _ensure_process_groups(sizes: ParallelSizes):
    """The current process groups, set up first if nothing is (plain process or torchrun)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    select_backend().activate()
    init_world()
    want = (sizes.tp, sizes.pp, sizes.ep, sizes.cp, sizes.etp or sizes.tp, sizes.vpp)
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
        )
        if have != want:
            raise ValueError(
                f"model parallelism is already set up as TP/PP/EP/CP/ETP/VPP {have}, but "
                f"load_hf_model was asked for {want}; pass the sizes of the current setup"
            )
        return ProcessGroupCollection.use_mpu_process_groups()
    world = dist.get_world_size()
    if world % (sizes.tp * sizes.pp * sizes.cp):
        raise ValueError(
            f"{world} processes cannot hold tensor_model_parallel_size x "
            f"pipeline_model_parallel_size x context_parallel_size = "
            f"{sizes.tp * sizes.pp * sizes.cp}"
        )
    return initialize_model_parallel(
        tp=sizes.tp, pp=sizes.pp, vpp=sizes.vpp, ep=sizes.ep, cp=sizes.cp, etp=sizes.etp
    )


def stack_spec_for(conversion: HFConversion, backend: str, config, mamba_impl: str = "auto"):
    """``hybrid_stack_spec(backend)`` computing the conversion's model as transformers does.

    The torch Mamba2 path gets the family's Mamba numerics (``conversion.mamba_mixer_params``);
    megatron-core's ``MambaMixer`` takes neither argument, so where it is chosen the
    conversion's notes on what then differs are issued as a warning.
    """
    base_spec = hybrid_stack_spec(backend, config=config, mamba_impl=mamba_impl)
    spec = with_mixer_params(base_spec, conversion.mamba_mixer_params)
    uses_mamba = conversion.pattern.layer_counts.get(MAMBA)
    if spec is base_spec and conversion.mamba_mixer_params and uses_mamba:
        differ = [note for note in conversion.notes if "MambaMixer" in note]
        if differ:
            warnings.warn("; ".join(differ), stacklevel=3)
    return spec


def build_model(
    conversion: HFConversion,
    pg_collection,
    *,
    transformer_impl: str = "local",
    params_dtype: torch.dtype | None = None,
    parallel_output: bool = False,
    mamba_impl: str = "auto",
    sequence_parallel: bool | None = None,
    vp_stage: int | None = None,
    hybrid_layer_pattern: str | None = None,
    **config_overrides,
):
    """The HybridModel of a conversion on this rank's pipeline stage (weights not loaded).

    ``sequence_parallel`` None: on whenever TP is. Under virtual pipeline parallelism
    ``vp_stage`` picks the chunk and ``hybrid_layer_pattern`` is the conversion's pattern with
    the ``|`` boundaries of the virtual stages (``megatron_hybrid.pattern.with_stages``).
    """
    if transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(
            f"transformer_impl={transformer_impl!r}: choose 'local' or 'transformer_engine'"
        )
    dtype = params_dtype or conversion.dtype
    pp = pg_collection.pp
    pattern = hybrid_layer_pattern or conversion.pattern.pattern
    vpp = virtual_stages(pattern, pp.size()) if PIPE in pattern else 1
    vpp = vpp if vpp > 1 else None
    if sequence_parallel is None:
        # megatron-core wants sequence parallelism with MoE under TP; the package's norms
        # support it for every layer type, so it is on whenever TP is.
        sequence_parallel = pg_collection.tp.size() > 1
    config = conversion.transformer_config(
        **select_backend().config_overrides(),
        tensor_model_parallel_size=pg_collection.tp.size(),
        pipeline_model_parallel_size=pp.size(),
        expert_model_parallel_size=pg_collection.ep.size(),
        expert_tensor_parallel_size=pg_collection.expt_tp.size(),
        context_parallel_size=pg_collection.cp.size(),
        virtual_pipeline_model_parallel_size=vpp,
        **pipeline_p2p_fields(vpp),
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        transformer_impl=transformer_impl,
        **config_overrides,
    )
    vocab = conversion.model_kwargs["vocab_size"]
    if vocab % pg_collection.tp.size():
        raise ValueError(
            f"vocab_size {vocab} is not divisible by tensor_model_parallel_size "
            f"{pg_collection.tp.size()}; choose a TP size that divides it"
        )
    backend = "te" if transformer_impl == "transformer_engine" else "local"
    kwargs = dict(conversion.model_kwargs)
    model = HybridModel(
        config,
        stack_spec_for(conversion, backend, config, mamba_impl),
        vocab_size=kwargs.pop("vocab_size"),
        max_sequence_length=kwargs.pop("max_sequence_length"),
        hybrid_layer_pattern=pattern,
        pre_process=pp.rank() == 0 and vp_stage in (None, 0),
        post_process=pp.rank() == pp.size() - 1 and vp_stage in (None, (vpp or 1) - 1),
        parallel_output=parallel_output,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        **kwargs,
    )
    model.hf_conversion = conversion
    if dtype != torch.float32:
        # As Float16Module does for training: torch norms are built in float32. Buffers (the
        # router's expert bias) stay float32, as megatron-core keeps them.
        for param in model.parameters():
            if param.dtype == torch.float32:
                param.data = param.data.to(dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def load_hf_model(
    path,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    sequence_parallel: bool | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    transformer_impl: str = "local",
    params_dtype: torch.dtype | None = None,
    mtp: bool | None = None,
    ignore_config_fields=(),
    progress=None,
    config_overrides: dict | None = None,
    mamba_impl: str = "auto",
    conversion: HFConversion | None = None,
    plan: Plan | None = None,
):
    """Build the model a Hugging Face folder describes and load its weights strictly.

    Sets up the process groups if none exist (a plain process: a one-rank world; under
    torchrun: the job's world), as ``train`` does; otherwise uses the current ones, which must
    have the requested sizes. Takes every parallel size ``train`` takes; what a layout cannot do
    is refused by the argument's name before anything is built.

    Args:
        path: folder with config.json and safetensors (sharded with an index or not), or an
            open ``HFCheckpoint``.
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size; the pattern is split by physical layers.
        expert_model_parallel_size: EP size.
        expert_tensor_parallel_size: expert TP size (None: the TP size).
        context_parallel_size: CP size (needs ``transformer_impl="transformer_engine"``;
            ``forward_logprobs`` and ``PolicyTrainer`` do not run it yet and say so).
        sequence_parallel: None: on whenever TP is (MoE layers need it under TP).
        virtual_pipeline_model_parallel_size: virtual stages per pipeline rank: the pattern is
            cut into ``pp x vpp`` stages of nearly equal logical layer counts
            (``megatron_hybrid.pattern.with_stages``), and one chunk per stage is returned.
        transformer_impl: ``"local"`` (Megatron-Core modules) or ``"transformer_engine"``.
        params_dtype: parameter dtype (default: the checkpoint's).
        mtp: load the MTP layers the config declares (None: when the checkpoint holds them).
        ignore_config_fields: config fields to accept although they are not mapped.
        progress: optional ``(done, total)`` callback while weights are copied.
        config_overrides: further ``TransformerConfig`` fields (e.g. ``deterministic_mode``
            for GatedDeltaNet's torch path on a GPU, recompute settings).
        mamba_impl: how ``M`` layers compute (``hybrid_stack_spec``'s argument): ``"auto"``,
            ``"torch"`` (transformers' Mamba numerics exactly, see ``conversion.notes``) or
            ``"kernels"`` (megatron-core's ``MambaMixer``).
        conversion, plan: a :func:`check_conversion` result's, so that the config is not
            converted (``mtp`` and ``ignore_config_fields`` are then its) and the weights not
            planned again.

    Returns:
        This rank's HybridModel (``model(input_ids, position_ids, None)`` gives logits
        ``[batch, seq, vocab]`` on the last pipeline stage), with ``hf_conversion`` attached;
        under virtual pipeline parallelism the list of this rank's chunks, in stage order.

    Raises:
        ValueError: a parallel size the layout cannot run (named), or one that does not fit
            the current process groups or the world.
    """
    source = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    if conversion is None:
        conversion = conversion_for(source, mtp=mtp, ignore_config_fields=ignore_config_fields)
    sizes = ParallelSizes(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        ep=expert_model_parallel_size,
        cp=context_parallel_size,
        vpp=virtual_pipeline_model_parallel_size,
        etp=expert_tensor_parallel_size,
        sequence_parallel=sequence_parallel,
    )
    has_experts = bool(conversion.pattern.layer_counts.get(MOE))
    refused = sizes.unsupported(transformer_impl, has_experts)
    if refused:
        raise ValueError(f"load_hf_model: {refused}")
    pattern = None
    if sizes.vpp is not None:
        try:
            pattern = with_stages(conversion.pattern, sizes.pp * sizes.vpp)
        except ValueError as error:
            raise ValueError(
                f"load_hf_model: virtual_pipeline_model_parallel_size={sizes.vpp}: {error}"
            ) from None
    pg = _ensure_process_groups(sizes)
    options = dict(
        transformer_impl=transformer_impl,
        params_dtype=params_dtype,
        mamba_impl=mamba_impl,
        sequence_parallel=sizes.sp,
        hybrid_layer_pattern=pattern,
        **(config_overrides or {}),
    )
    stages = range(sizes.vpp) if sizes.vpp is not None else [None]
    chunks = [build_model(conversion, pg, vp_stage=v, **options) for v in stages]
    load_hf_weights(chunks, source, conversion, progress=progress, plan=plan)
    return chunks if sizes.vpp is not None else chunks[0]

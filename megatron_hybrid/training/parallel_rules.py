"""Flag rules about the process-group layout (scope ``parallel``) and the ``train`` loop, its
data and checkpoint folders (scope ``train``). The requirements follow megatron-core 0.19.2
(``parallel_state.py``, ``transformer/transformer_config.py``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from megatron_hybrid.pattern import (
    MOE,
    ParsedPattern,
    parse_pattern,
    pipeline_segments,
    virtual_stages,
    with_option_names,
)
from megatron_hybrid.training import capabilities
from megatron_hybrid.training.settings import Rule, Settings, rule

__all__ = ["PARALLEL_RULES", "TRAIN_RULES", "vpp_size_from_pattern"]


def vpp_size_from_pattern(pattern: str | ParsedPattern, pp_size: int) -> int | None:
    """Virtual pipeline size implied by the pattern's ``|`` segments (None without pipes).

    Raises:
        ValueError: the segment count is not a multiple of ``pp_size``, or pipes without PP.
    """
    parsed = parse_pattern(pattern)
    try:
        vpp = virtual_stages(parsed, pp_size)
    except ValueError as error:
        raise with_option_names(error, {"pp_size": "--pipeline-model-parallel-size"}) from None
    if vpp > 1 and pp_size == 1:
        raise ValueError(
            f"the pattern has {parsed.num_segments} '|'-separated segments but there is no "
            "pipeline parallelism; drop the '|' or set --pipeline-model-parallel-size"
        )
    return vpp if vpp > 1 else None


def _tp_divides(s: Settings) -> str | None:
    tp = s.tp
    sizes = [("--num-attention-heads", s.args.num_attention_heads),
             ("--num-query-groups", s.args.num_query_groups or s.args.num_attention_heads),
             ("--ffn-hidden-size", s.args.ffn_hidden_size or 4 * s.args.hidden_size),
             ("--vocab-size", s.args.vocab_size)]  # fmt: skip
    for flag, value in sizes:
        if value is not None and value % tp:  # None: resolved later (a tokenizer's, padded)
            return (
                f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}: every TP "
                f"rank holds an equal share; use a multiple of {tp}"
            )
    return None


def _sequence_parallel(s: Settings) -> str | None:
    if s.args.sequence_parallel and s.tp == 1:
        return "--sequence-parallel needs --tensor-model-parallel-size > 1"
    return None


def _context_parallel(s: Settings) -> str | None:
    if s.args.context_parallel_size > 1 and s.args.transformer_impl != "transformer_engine":
        return (
            f"--context-parallel-size {s.args.context_parallel_size} needs TransformerEngine's "
            "attention: add --transformer-impl transformer_engine"
        )
    return None


def _world(s: Settings) -> str | None:
    model = s.tp * s.args.pipeline_model_parallel_size * s.args.context_parallel_size
    if s.world_size % model:
        return (
            f"{s.world_size} process(es) cannot hold --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size = {model}: launch a "
            f"multiple of {model} processes (torchrun --nproc_per_node) or lower the sizes"
        )
    return None


def _expert_world(s: Settings) -> str | None:
    ep = s.args.expert_model_parallel_size
    expert = s.etp * ep * s.args.pipeline_model_parallel_size
    if s.world_size % expert:
        return (
            f"--expert-model-parallel-size {ep} x expert TP {s.etp} x PP "
            f"{s.args.pipeline_model_parallel_size} = {expert} does not divide the {s.world_size} "
            f"process(es): launch a multiple of {expert} processes or lower "
            "--expert-model-parallel-size"
        )
    return None


def _experts_per_rank(s: Settings) -> str | None:
    ep = s.args.expert_model_parallel_size
    if s.has(MOE) and s.args.num_experts % ep:
        return (
            f"--num-experts {s.args.num_experts} is not divisible by --expert-model-parallel-size "
            f"{ep}: every EP rank holds the same number of experts; use a multiple of {ep}"
        )
    return None


def _flex(s: Settings) -> str | None:
    if not s.has(MOE) or s.args.moe_token_dispatcher_type != "flex":
        return None
    if s.tp * s.args.expert_model_parallel_size == 1:
        return (
            "--moe-token-dispatcher-type flex needs --tensor-model-parallel-size x "
            "--expert-model-parallel-size > 1; use alltoall for a single rank"
        )
    if not s.on_gpu:
        return "--moe-token-dispatcher-type flex needs CUDA GPUs; use alltoall"
    backend = s.args.moe_flex_dispatcher_backend
    problem = capabilities.flex_backend_unavailable(backend)
    if problem:
        return f"--moe-flex-dispatcher-backend {backend} {problem} (or use alltoall)"
    return None


def _overlap(s: Settings) -> str | None:
    if not s.args.overlap_moe_expert_parallel_comm:
        return None
    flag = "--overlap-moe-expert-parallel-comm"
    if s.args.expert_model_parallel_size < 2:
        return f"{flag} overlaps the EP all-to-all: it needs --expert-model-parallel-size > 1"
    if not s.has(MOE):
        return f"{flag} needs MoE ('E') layers in the pattern"
    if not s.args.bf16:
        return f"{flag} needs --bf16"
    if s.args.moe_token_dispatcher_type not in ("alltoall", "flex"):
        return f"{flag} needs --moe-token-dispatcher-type alltoall or flex"
    if (
        s.args.recompute_granularity == "full"
        or s.args.recompute_method
        or s.args.recompute_num_layers
    ):
        return f"{flag} cannot be combined with full recompute: drop the --recompute-* flags"
    parsed = s.parsed
    if parsed.mtp_num_depths > 1:
        return f"{flag} supports at most one MTP depth; the pattern has {parsed.mtp_num_depths}"
    if s.args.pipeline_model_parallel_size > 1 and parsed.num_segments == 1:
        return (
            f"{flag} with --pipeline-model-parallel-size > 1 needs virtual stages: split the "
            "pattern into 2 x PP segments with '|'"
        )
    return None


def _delay_wgrad(s: Settings) -> str | None:
    if s.args.delay_wgrad_compute and not s.args.overlap_moe_expert_parallel_comm:
        return "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"
    return None


def _recompute(s: Settings) -> str | None:
    granularity, method, layers = (
        s.args.recompute_granularity, s.args.recompute_method, s.args.recompute_num_layers
    )  # fmt: skip
    if granularity == "full" and (method is None or layers is None):
        return (
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers N"
        )
    if granularity != "full" and (method is not None or layers is not None):
        return "--recompute-method and --recompute-num-layers need --recompute-granularity full"
    return None


def _pipeline(s: Settings) -> str | None:
    pp = s.args.pipeline_model_parallel_size
    parsed = s.parsed
    try:
        vpp_size_from_pattern(parsed, pp)
    except ValueError as error:
        return str(error)
    if parsed.num_segments == 1 and pp > 1:
        total = parsed.physical_layer_count
        if total % pp:
            return (
                f"--pipeline-model-parallel-size {pp} must divide the {total} physical layers of "
                f"{s.args.hybrid_layer_pattern!r}: put {pp - 1} '|' between logical layers to "
                "choose the stages"
            )
        try:
            pipeline_segments(parsed, pp)
        except ValueError as error:  # a stage boundary inside a group: the '|' hint is CLI-ready
            return str(with_option_names(error, {"pp_size": "--pipeline-model-parallel-size"}))
    return None


def _global_batch(s: Settings) -> str | None:
    per_step = s.args.micro_batch_size * s.data_parallel_size
    if s.args.global_batch_size and s.args.global_batch_size % per_step:
        return (
            f"--global-batch-size {s.args.global_batch_size} is not a multiple of "
            f"--micro-batch-size x data-parallel size = {s.args.micro_batch_size} x "
            f"{s.data_parallel_size} = {per_step}"
        )
    return None


def _save_writable(s: Settings) -> str | None:
    if not s.args.save:
        return None
    path = Path(s.args.save)
    if path.exists() and not path.is_dir():
        return f"--save {s.args.save} is a file; checkpoints go into a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Probe with a real file: permission bits alone miss read-only and virtual file systems.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        reason = error.strerror or error
        return f"--save {s.args.save} cannot be written ({reason}): choose a writable directory"
    return None


def _load_exists(s: Settings) -> str | None:
    # --load D --save D may name a folder that does not exist yet: the first run of an
    # automatic restart loop starts from scratch there, as Megatron-LM does.
    same_as_save = s.args.save and Path(s.args.load or "").resolve() == Path(s.args.save).resolve()
    if s.args.load and not Path(s.args.load).exists() and not same_as_save:
        return (
            f"--load {s.args.load} does not exist; check the path (a folder that --save also names "
            "may be new: the run then starts from scratch)"
        )
    return None


def _force_balance(s: Settings) -> str | None:
    if s.args.moe_router_force_load_balancing and not s.has(MOE):
        return (
            f"--moe-router-force-load-balancing: the pattern {s.args.hybrid_layer_pattern!r} "
            "has no MoE ('E') layer to route for; drop the flag"
        )
    return None


#: Parallel-layout rules, in the order they are checked.
PARALLEL_RULES: tuple[Rule, ...] = (
    rule("parallel", "--tensor-model-parallel-size", _tp_divides),
    rule("parallel", "--sequence-parallel", _sequence_parallel),
    rule("parallel", "--context-parallel-size --transformer-impl", _context_parallel),
    rule("parallel", "--pipeline-model-parallel-size", _pipeline),
    rule("parallel", "--tensor-model-parallel-size --pipeline-model-parallel-size", _world),
    rule("parallel", "--expert-model-parallel-size", _expert_world),
    rule("parallel", "--num-experts --expert-model-parallel-size", _experts_per_rank),
    rule("parallel", "--moe-token-dispatcher-type", _flex),
    rule("parallel", "--overlap-moe-expert-parallel-comm", _overlap),
    rule("parallel", "--delay-wgrad-compute", _delay_wgrad),
)

#: Rules of the train command, in the order they are checked.
TRAIN_RULES: tuple[Rule, ...] = (
    rule("train", "--recompute-granularity --recompute-method", _recompute),
    rule("train", "--global-batch-size --micro-batch-size", _global_batch),
    rule("train", "--load", _load_exists),
    rule("train", "--save", _save_writable),
    rule("train", "--moe-router-force-load-balancing", _force_balance),
)

"""Every setting checked before work starts: one table of rules over the parsed flags.

megatron-core rejects many flag combinations only deep inside model or process-group
construction (a bare ``AssertionError``, ``ZeroDivisionError`` or a kernel's index error), and
some it accepts although they train wrongly (a negative ``--clip-grad`` reverses the update,
``--moe-router-topk 0`` routes no token). :func:`validate_settings` checks the flags against
:data:`RULES` before any process group or model exists and raises :class:`SettingsError` naming
the flag and the fix. The world size comes from ``WORLD_SIZE`` (torchrun sets it), so every rank
reaches the same verdict without communicating; the CLI prints it on rank 0 only.

Rules come in scopes: ``model`` (what the layers need; ``check-checkpoint`` uses only these),
``device`` (kernels and libraries this machine must have), ``parallel`` (process-group layout)
and ``train`` (the ``train`` command's loop, data and checkpoint folders). The requirements
cited follow megatron-core 0.19.2 (``transformer/transformer_config.py``, ``parallel_state.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from megatron_hybrid.pattern import DSA, GDN, MAMBA, MLA, MOE, parse_pattern
from megatron_hybrid.training import capabilities

__all__ = [
    "RULES",
    "SCOPES",
    "Rule",
    "Settings",
    "SettingsError",
    "validate_settings",
]

SCOPES = ("model", "device", "parallel", "train")


class SettingsError(ValueError):
    """A flag (or combination) that cannot work; the message names the flag and the fix."""


@dataclass
class Settings:
    """The flags of one invocation plus what follows from them (pattern, world size, device)."""

    args: argparse.Namespace
    world_size: int
    on_gpu: bool

    def __getattr__(self, name: str):
        return getattr(self.args, name)

    @cached_property
    def counts(self) -> dict[str, int]:
        return parse_pattern(self.args.hybrid_layer_pattern).layer_counts

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


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _at_least(scope: str, flag: str, minimum: float, why: str) -> Rule:
    """``flag`` must be >= ``minimum`` when set (None means: use the default)."""

    def problem(s: Settings) -> str | None:
        value = getattr(s.args, _dest(flag), None)
        if value is None or value >= minimum:
            return None
        return f"{flag} {value} must be >= {minimum}{why}"

    return Rule(scope, (flag,), problem)


# Sizes and counts that must be positive (megatron-core divides by most of them):
# (scope, flag, minimum, why).
_MINIMUMS: tuple[tuple[str, str, float, str], ...] = (
    ("parallel", "--tensor-model-parallel-size", 1, ""),
    ("parallel", "--pipeline-model-parallel-size", 1, ""),
    ("parallel", "--expert-model-parallel-size", 1, ""),
    ("parallel", "--expert-tensor-parallel-size", 1, ""),
    ("parallel", "--context-parallel-size", 1, ""),
    ("model", "--hidden-size", 1, ""),
    ("model", "--num-attention-heads", 1, ""),
    ("model", "--num-query-groups", 1, ""),
    ("model", "--kv-channels", 1, ""),
    ("model", "--ffn-hidden-size", 1, ""),
    ("model", "--vocab-size", 1, ""),
    ("model", "--max-position-embeddings", 1, ""),
    ("model", "--num-experts", 1, ""),
    ("model", "--moe-router-topk", 1, " (each token goes to at least one expert)"),
    ("model", "--moe-ffn-hidden-size", 1, ""),
    ("model", "--moe-shared-expert-intermediate-size", 1, ""),
    ("model", "--moe-aux-loss-coeff", 0, ""),
    ("model", "--q-lora-rank", 1, ""),
    ("model", "--kv-lora-rank", 1, ""),
    ("model", "--qk-head-dim", 1, ""),
    ("model", "--qk-pos-emb-head-dim", 1, ""),
    ("model", "--v-head-dim", 1, ""),
    ("train", "--micro-batch-size", 1, ""),
    ("train", "--global-batch-size", 1, ""),
    ("train", "--seq-length", 8, " (the synthetic data's shortest sequence is 8)"),
    ("train", "--vocab-size", 4, " (the synthetic data reserves token 0 for padding)"),
    ("train", "--train-iters", 1, ""),
    ("train", "--save-interval", 1, "; leave it out to save only at the end"),
    ("train", "--lr", 0, " (a negative rate climbs the loss)"),
    ("train", "--weight-decay", 0, ""),
    ("train", "--clip-grad", 0, " (0 turns clipping off; a negative value reverses the update)"),
    ("train", "--recompute-num-layers", 1, ""),
)


def _pattern(s: Settings) -> str | None:
    if not s.hybrid_layer_pattern:
        return "--hybrid-layer-pattern is required, e.g. --hybrid-layer-pattern '[*E]{4}'"
    parse_pattern(s.hybrid_layer_pattern)  # HybridPatternError (a ValueError) with a caret
    return None


def _moe_needs_experts(s: Settings) -> str | None:
    if s.has(MOE) and not s.num_experts:
        return f"the pattern {s.hybrid_layer_pattern!r} has MoE ('E') layers; set --num-experts"
    return None


def _topk(s: Settings) -> str | None:
    if s.has(MOE) and s.moe_router_topk > s.num_experts:
        return (
            f"--moe-router-topk {s.moe_router_topk} exceeds --num-experts {s.num_experts}: "
            f"use at most {s.num_experts} experts per token"
        )
    return None


def _topk_one(s: Settings) -> str | None:
    if s.has(MOE) and s.moe_router_topk == 1 and not s.moe_router_pre_softmax:
        # A softmax over one selected score is constant 1: the router would get no gradient.
        return "--moe-router-topk 1 needs --moe-router-pre-softmax (softmax before the top-1)"
    return None


def _heads(s: Settings) -> str | None:
    if s.kv_channels is None and s.hidden_size < s.num_attention_heads:
        return (
            f"--hidden-size {s.hidden_size} is smaller than --num-attention-heads "
            f"{s.num_attention_heads}: a head needs at least one channel; set --kv-channels or "
            "use fewer heads"
        )
    return None


def _query_groups(s: Settings) -> str | None:
    groups = s.num_query_groups
    if groups and s.num_attention_heads % groups:
        return (
            f"--num-query-groups {groups} must divide --num-attention-heads "
            f"{s.num_attention_heads} (each group shares its keys and values among whole heads)"
        )
    return None


def _rope_head_dim(s: Settings) -> str | None:
    if s.position_embedding_type != "rope" or s.head_dim % 2 == 0:
        return None
    if s.kv_channels is not None:
        source = f"--kv-channels {s.kv_channels}"
    else:
        source = f"--hidden-size {s.hidden_size} / --num-attention-heads {s.num_attention_heads}"
    return (
        f"RoPE rotates channel pairs, but the head dimension is {s.head_dim} ({source}): make "
        f"it even, e.g. --kv-channels {s.head_dim + 1}"
    )


def _mla(s: Settings) -> str | None:
    if not s.has(MLA) or s.transformer_impl != "local":
        return None
    if not capabilities.mla_core_attention_usable("local"):
        return (
            "'+' (MLA) layers with --transformer-impl local need a core attention with separate "
            "key and value head dims, which megatron-core 0.19.2's local attention lacks: use "
            "--transformer-impl transformer_engine on GPUs"
        )
    return None


def _mla_rope(s: Settings) -> str | None:
    if s.has(MLA) and s.qk_pos_emb_head_dim % 2:
        return f"--qk-pos-emb-head-dim {s.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)"
    return None


def _learned_positions(s: Settings) -> str | None:
    limit = s.max_position_embeddings
    if s.position_embedding_type == "learned_absolute" and limit and limit < s.seq_length:
        return (
            f"--max-position-embeddings {limit} is below --seq-length {s.seq_length}: learned "
            f"absolute positions exist only up to {limit}; raise it or lower --seq-length"
        )
    return None


def _gdn(s: Settings) -> str | None:
    if s.has(GDN) and not s.swiglu:
        return (
            "GatedDeltaNet ('G') layers use the model's activation, which must be SiLU: "
            "add --swiglu"
        )
    return None


def _gdn_kernels(s: Settings) -> str | None:
    if not s.has(GDN) or not s.on_gpu:
        return None
    if not capabilities.fla_installed():
        return "GatedDeltaNet ('G') layers on GPUs need fla-core: pip install fla-core"
    reason = capabilities.fla_gated_backward_refused()
    if reason:
        return f"'G' layers: {reason}; pip install 'triton>=3.7.1' or pip install tilelang"
    return None


def _mamba(s: Settings) -> str | None:
    if not s.has(MAMBA) or getattr(s.args, "mamba_impl", "auto") != "kernels":
        return None  # 'auto' falls back to the torch Mamba2 path where the kernels cannot run
    usable, reason = capabilities.mamba_kernels_usable()
    if not usable:
        return (
            f"--mamba-impl kernels needs megatron-core's Mamba kernels, but {reason}: install "
            "mamba-ssm and causal-conv1d on a CUDA machine, or use --mamba-impl auto (the torch "
            "Mamba2 path)"
        )
    return None


def _dsa(s: Settings) -> str | None:
    if s.has(DSA):
        return (
            "'D' (DeepSeek sparse attention) layers need DSA indexer settings that these flags "
            "do not cover: build them through the Python API (MLATransformerConfig with "
            "dsa_indexer_* fields and hybrid_stack_spec('te'))"
        )
    return None


def _transformer_engine(s: Settings) -> str | None:
    if s.transformer_impl != "transformer_engine":
        return None
    if not s.on_gpu:
        return "--transformer-impl transformer_engine needs CUDA GPUs; use --transformer-impl local"
    if importlib.util.find_spec("transformer_engine") is None:
        return (
            "--transformer-impl transformer_engine needs TransformerEngine, which is not "
            "installed; install it or use --transformer-impl local"
        )
    return None


def _tp_divides(s: Settings) -> str | None:
    tp = s.tp
    sizes = [("--num-attention-heads", s.num_attention_heads),
             ("--num-query-groups", s.num_query_groups or s.num_attention_heads),
             ("--ffn-hidden-size", s.ffn_hidden_size or 4 * s.hidden_size),
             ("--vocab-size", s.vocab_size)]  # fmt: skip
    for flag, value in sizes:
        if value % tp:
            return (
                f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}: every TP "
                f"rank holds an equal share; use a multiple of {tp}"
            )
    return None


def _sequence_parallel(s: Settings) -> str | None:
    if s.sequence_parallel and s.tp == 1:
        return "--sequence-parallel needs --tensor-model-parallel-size > 1"
    return None


def _context_parallel(s: Settings) -> str | None:
    if s.context_parallel_size > 1 and s.transformer_impl != "transformer_engine":
        return (
            f"--context-parallel-size {s.context_parallel_size} needs TransformerEngine's "
            "attention: add --transformer-impl transformer_engine"
        )
    return None


def _world(s: Settings) -> str | None:
    model = s.tp * s.pipeline_model_parallel_size * s.context_parallel_size
    if s.world_size % model:
        return (
            f"{s.world_size} process(es) cannot hold --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size = {model}: launch a "
            f"multiple of {model} processes (torchrun --nproc_per_node) or lower the sizes"
        )
    return None


def _expert_world(s: Settings) -> str | None:
    ep = s.expert_model_parallel_size
    expert = s.etp * ep * s.pipeline_model_parallel_size
    if s.world_size % expert:
        return (
            f"--expert-model-parallel-size {ep} x expert TP {s.etp} x PP "
            f"{s.pipeline_model_parallel_size} = {expert} does not divide the {s.world_size} "
            f"process(es): launch a multiple of {expert} processes or lower "
            "--expert-model-parallel-size"
        )
    return None


def _experts_per_rank(s: Settings) -> str | None:
    ep = s.expert_model_parallel_size
    if s.has(MOE) and s.num_experts % ep:
        return (
            f"--num-experts {s.num_experts} is not divisible by --expert-model-parallel-size "
            f"{ep}: every EP rank holds the same number of experts; use a multiple of {ep}"
        )
    return None


def _flex(s: Settings) -> str | None:
    if not s.has(MOE) or s.moe_token_dispatcher_type != "flex":
        return None
    if s.tp * s.expert_model_parallel_size == 1:
        return (
            "--moe-token-dispatcher-type flex needs --tensor-model-parallel-size x "
            "--expert-model-parallel-size > 1; use alltoall for a single rank"
        )
    if not s.on_gpu:
        return "--moe-token-dispatcher-type flex needs CUDA GPUs; use alltoall"
    if importlib.util.find_spec("deep_ep") is None:  # DeepEP ships both backends
        return (
            f"--moe-flex-dispatcher-backend {s.moe_flex_dispatcher_backend} needs DeepEP "
            "(the deep_ep package), which is not installed; use alltoall"
        )
    return None


def _overlap(s: Settings) -> str | None:
    if not s.overlap_moe_expert_parallel_comm:
        return None
    flag = "--overlap-moe-expert-parallel-comm"
    if s.expert_model_parallel_size < 2:
        return f"{flag} overlaps the EP all-to-all: it needs --expert-model-parallel-size > 1"
    if not s.has(MOE):
        return f"{flag} needs MoE ('E') layers in the pattern"
    if not s.bf16:
        return f"{flag} needs --bf16"
    if s.moe_token_dispatcher_type not in ("alltoall", "flex"):
        return f"{flag} needs --moe-token-dispatcher-type alltoall or flex"
    if s.recompute_granularity == "full" or s.recompute_method or s.recompute_num_layers:
        return f"{flag} cannot be combined with full recompute: drop the --recompute-* flags"
    parsed = parse_pattern(s.hybrid_layer_pattern)
    if parsed.mtp_num_depths > 1:
        return f"{flag} supports at most one MTP depth; the pattern has {parsed.mtp_num_depths}"
    if s.pipeline_model_parallel_size > 1 and parsed.num_segments == 1:
        return (
            f"{flag} with --pipeline-model-parallel-size > 1 needs virtual stages: split the "
            "pattern into 2 x PP segments with '|'"
        )
    return None


def _delay_wgrad(s: Settings) -> str | None:
    if s.delay_wgrad_compute and not s.overlap_moe_expert_parallel_comm:
        return "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"
    return None


def _recompute(s: Settings) -> str | None:
    granularity, method, layers = (
        s.recompute_granularity, s.recompute_method, s.recompute_num_layers
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
    from megatron_hybrid.pattern import pipeline_segments
    from megatron_hybrid.pattern.pipeline import with_option_names
    from megatron_hybrid.training.arguments import vpp_size_from_pattern

    pp = s.pipeline_model_parallel_size
    parsed = parse_pattern(s.hybrid_layer_pattern)
    try:
        vpp_size_from_pattern(parsed, pp)
    except ValueError as error:
        return str(error)
    if parsed.num_segments == 1 and pp > 1:
        total = parsed.physical_layer_count
        if total % pp:
            return (
                f"--pipeline-model-parallel-size {pp} must divide the {total} physical layers of "
                f"{s.hybrid_layer_pattern!r}: put {pp - 1} '|' between logical layers to choose "
                "the stages"
            )
        try:
            pipeline_segments(parsed, pp)
        except ValueError as error:  # a stage boundary inside a group: the '|' hint is CLI-ready
            return str(with_option_names(error, {"pp_size": "--pipeline-model-parallel-size"}))
    return None


def _global_batch(s: Settings) -> str | None:
    per_step = s.micro_batch_size * s.data_parallel_size
    if s.global_batch_size and s.global_batch_size % per_step:
        return (
            f"--global-batch-size {s.global_batch_size} is not a multiple of --micro-batch-size "
            f"x data-parallel size = {s.micro_batch_size} x {s.data_parallel_size} = {per_step}"
        )
    return None


def _save_writable(s: Settings) -> str | None:
    if not s.save:
        return None
    path = Path(s.save)
    if path.exists() and not path.is_dir():
        return f"--save {s.save} is a file; checkpoints go into a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Probe with a real file: permission bits alone miss read-only and virtual file systems.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        reason = error.strerror or error
        return f"--save {s.save} cannot be written ({reason}): choose a writable directory"
    return None


def _load_exists(s: Settings) -> str | None:
    # --load D --save D may name a folder that does not exist yet: the first run of an
    # automatic restart loop starts from scratch there, as Megatron-LM does.
    same_as_save = s.save and Path(s.load or "").resolve() == Path(s.save).resolve()
    if s.load and not Path(s.load).exists() and not same_as_save:
        return (
            f"--load {s.load} does not exist; check the path (a folder that --save also names "
            "may be new: the run then starts from scratch)"
        )
    return None


def _rule(scope: str, flags: str, problem: Callable[[Settings], str | None]) -> Rule:
    return Rule(scope, tuple(flags.split()), problem)


#: Every rule, in the order they are checked (the first failing one is reported). Sizes come
#: first so the later rules may divide by them.
RULES: tuple[Rule, ...] = (
    _rule("model", "--hybrid-layer-pattern", _pattern),
    *(_at_least(*row) for row in _MINIMUMS),
    _rule("model", "--num-experts", _moe_needs_experts),
    _rule("model", "--moe-router-topk --num-experts", _topk),
    _rule("model", "--moe-router-topk --moe-router-pre-softmax", _topk_one),
    _rule("model", "--hidden-size --num-attention-heads --kv-channels", _heads),
    _rule("model", "--num-query-groups --num-attention-heads", _query_groups),
    _rule("model", "--hidden-size --num-attention-heads --kv-channels", _rope_head_dim),
    _rule("model", "--qk-pos-emb-head-dim", _mla_rope),
    _rule("model", "--max-position-embeddings --seq-length", _learned_positions),
    _rule("model", "--swiglu", _gdn),
    _rule("model", "--hybrid-layer-pattern", _dsa),
    _rule("device", "--hybrid-layer-pattern", _gdn_kernels),
    _rule("device", "--hybrid-layer-pattern", _mamba),
    _rule("device", "--transformer-impl", _transformer_engine),
    _rule("device", "--hybrid-layer-pattern --transformer-impl", _mla),
    _rule("parallel", "--tensor-model-parallel-size", _tp_divides),
    _rule("parallel", "--sequence-parallel", _sequence_parallel),
    _rule("parallel", "--context-parallel-size --transformer-impl", _context_parallel),
    _rule("parallel", "--pipeline-model-parallel-size", _pipeline),
    _rule("parallel", "--tensor-model-parallel-size --pipeline-model-parallel-size", _world),
    _rule("parallel", "--expert-model-parallel-size", _expert_world),
    _rule("parallel", "--num-experts --expert-model-parallel-size", _experts_per_rank),
    _rule("parallel", "--moe-token-dispatcher-type", _flex),
    _rule("parallel", "--overlap-moe-expert-parallel-comm", _overlap),
    _rule("parallel", "--delay-wgrad-compute", _delay_wgrad),
    _rule("train", "--recompute-granularity --recompute-method", _recompute),
    _rule("train", "--global-batch-size --micro-batch-size", _global_batch),
    _rule("train", "--load", _load_exists),
    _rule("train", "--save", _save_writable),
)


def validate_settings(
    args: argparse.Namespace,
    *,
    scopes: tuple[str, ...] = SCOPES,
    world_size: int | None = None,
    on_gpu: bool | None = None,
) -> None:
    """Check ``args`` against :data:`RULES` before anything is built.

    Args:
        args: parsed flags; flags the parser did not define take their defaults.
        scopes: which rule scopes apply (``check-checkpoint`` checks only ``model``).
        world_size: processes of the job (default: ``WORLD_SIZE``, else 1).
        on_gpu: whether the run uses CUDA (default: whether CUDA is available).

    Raises:
        SettingsError: the first rule that fails, naming the flag and the fix.
        HybridPatternError: the pattern does not parse.
    """
    from megatron_hybrid.training.arguments import with_defaults

    settings = Settings(
        with_defaults(args),
        int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size,
        capabilities.on_gpu() if on_gpu is None else on_gpu,
    )
    for rule in RULES:
        if rule.scope in scopes:
            problem = rule.problem(settings)
            if problem:
                raise SettingsError(problem)

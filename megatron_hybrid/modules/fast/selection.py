"""Where the fast TE-free path runs and where the reference path keeps the work: one module.

The ``local`` spec backend builds its layers from megatron-core's own modules (the *reference*
path: unfused attention, one GEMM per expert, megatron's torch GatedDeltaNet loop, the eager
torch Mamba2 scan). On a GPU those are correct but slow, so ``hybrid_stack_spec("local")``
builds the *fast* subclasses of :mod:`megatron_hybrid.modules.fast` there instead
(:func:`resolve_local_impl`). Each fast module keeps its reference class's parameters, buffers
and checkpoint keys, and before every forward asks this module whether its fast path applies
to the tensors and settings at hand; where it does not, the reference forward runs and the
reason is kept on the module (``fast_path_reason``; :func:`fast_path_report` lists them).

Every condition is written once, here: the spec decision (:func:`resolve_local_impl`) and the
per-call checks (``*_reason``), each returning ``None`` (fast) or why not, in words a user can
act on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any

import torch

from megatron_hybrid.modules.fla_backend import dqkwg_choice
from megatron_hybrid.padding.batch import host_values

__all__ = [
    "LOCAL_IMPLS",
    "chunk_sort_reason",
    "fast_path_report",
    "gather_permutation_reason",
    "gdn_rule_choice",
    "grouped_gemm_reason",
    "is_causal_mask",
    "mla_rope_reason",
    "resolve_local_impl",
    "rope_reason",
    "sdpa_reason",
    "sync_free_dispatch_reason",
    "varlen_parameters",
    "varlen_reason",
]

#: Values of ``hybrid_stack_spec(local_impl=...)``: ``"auto"`` (fast on CUDA, reference on the
#: CPU), ``"fast"`` (the fast modules everywhere, e.g. to test them on a CPU) or ``"reference"``.
LOCAL_IMPLS = ("auto", "fast", "reference")


def resolve_local_impl(local_impl: str) -> str:
    """``"fast"`` or ``"reference"`` for ``local_impl`` (one of :data:`LOCAL_IMPLS`).

    ``"auto"`` is ``"fast"`` where CUDA is available (the CPU runtime back-end hides CUDA, so
    CPU runs and tests build the reference path unless they ask for ``"fast"``).

    Raises:
        ValueError: unknown value.
    """
    if local_impl not in LOCAL_IMPLS:
        raise ValueError(f"local_impl must be one of {LOCAL_IMPLS}, got {local_impl!r}")
    if local_impl == "auto":
        return "fast" if torch.cuda.is_available() else "reference"
    return local_impl


# ---------------------------------------------------------------------------------------------
# Core attention through torch.nn.functional.scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


def sdpa_reason(module, query: torch.Tensor, key: torch.Tensor, attention_mask, attention_bias,
                attn_mask_type, packed_seq_params) -> str | None:  # fmt: skip
    """Why ``module`` (an SDPA core attention) must run its reference forward, or None.

    SDPA computes exactly softmax(q k^T * scale + mask) v; what it cannot express falls back:
    an additive attention bias, sliding windows, softmax sinks (``softmax_type``), a causal
    mask between query and key lengths that differ (SDPA aligns it top-left, megatron
    bottom-right) and packed batches whose query and key sequences differ.
    """
    config = module.config
    if attention_bias is not None:
        return "an attention_bias (SDPA's fused kernels take none)"
    if getattr(module.scale_mask_softmax, "window_size", None) is not None:
        return f"sliding-window attention (window_size={config.window_size})"
    if config.softmax_type != "vanilla":
        return f"softmax_type={config.softmax_type!r} (a learnable or off-by-one softmax sink)"
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    if thd:
        for q_name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
            q_offsets = getattr(packed_seq_params, q_name)
            kv_offsets = getattr(packed_seq_params, q_name.replace("_q", "_kv"))
            if kv_offsets is None or kv_offsets is q_offsets:
                continue
            if q_offsets is None or host_values(kv_offsets) != host_values(q_offsets):
                return "packed sequences whose key lengths differ from their query lengths"
        return None
    causal = attention_mask is None and is_causal_mask(attn_mask_type or module.attn_mask_type)
    if causal and query.shape[0] != key.shape[0]:
        return (
            f"a causal mask between {query.shape[0]} queries and {key.shape[0]} keys (SDPA "
            "aligns it top-left, megatron bottom-right)"
        )
    return None


@functools.cache
def varlen_parameters() -> frozenset[str] | str:
    """The keyword parameters of ``torch.nn.attention.varlen.varlen_attn``, or why it cannot
    serve: missing (it came in torch 2.9), or a signature without a way to give the softmax
    scale and the causal mask (``is_causal``; ``window_size=(-1, 0)`` in later torch)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (it came in torch 2.9)"
    names = frozenset(inspect.signature(varlen_attn).parameters)
    if "scale" not in names or not names & {"is_causal", "window_size"}:
        return f"torch {torch.__version__}'s varlen_attn takes no scale or causal mask"
    return names


def varlen_reason(query: torch.Tensor, value: torch.Tensor, *, causal: bool, dropout_p: float,
                  gaps: bool) -> str | None:  # fmt: skip
    """Why a packed (THD) batch's attention runs one SDPA call per sequence rather than one call
    of torch's varlen FlashAttention over all of them (``torch.nn.attention.varlen``), or None.

    One SDPA call per sequence costs a launch or more per sequence and layer, and each new
    length is a new shape for the kernel (cuDNN plans its kernels per shape); the varlen kernel
    takes the whole row and the offsets. It needs CUDA, bf16 or fp16, no dropout, one head size
    for queries, keys and values (not MLA's) of at most 256 in multiples of 8, and, where pad
    rows lie between sequences, a causal mask (each sequence's pad rows then follow it and no
    real token sees them). Whether the kernel then computes what the per-sequence calls compute
    on this GPU is :func:`~megatron_hybrid.modules.fast.attention.varlen_probe`'s question.
    ``MEGATRON_HYBRID_VARLEN=0`` keeps the per-sequence calls (for comparisons; the GPU suite's
    ``test_varlen_packed_attention`` checks both against float32).
    """
    if os.environ.get("MEGATRON_HYBRID_VARLEN", "1") == "0":
        return "turned off (MEGATRON_HYBRID_VARLEN=0)"
    if query.device.type != "cuda":
        return f"tensors on {query.device.type} (torch's varlen attention is a CUDA kernel)"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"{query.dtype} (FlashAttention takes bf16 or fp16)"
    if dropout_p > 0.0:
        return "attention dropout (varlen_attn has none)"
    dim = query.shape[-1]
    if value.shape[-1] != dim:
        return f"query/key heads of {dim} and value heads of {value.shape[-1]} (MLA)"
    if dim % 8 or dim > 256:
        return f"head size {dim} (FlashAttention takes multiples of 8 up to 256)"
    if gaps and not causal:
        return "pad rows between sequences without a causal mask (real tokens would see them)"
    names = varlen_parameters()
    return names if isinstance(names, str) else None


def rope_reason(module, rotary_pos_emb, packed_seq_params, inference_context) -> str | None:
    """Why ``module`` (a :class:`~megatron_hybrid.modules.fast.attention.FastSelfAttention`)
    must leave the rotary embedding to megatron's ``apply_rotary_pos_emb``, or None.

    :func:`~megatron_hybrid.modules.fast.rope.apply_rope` computes megatron's unfused,
    non-interleaved RoPE of padded batches in training, and
    :func:`~megatron_hybrid.modules.fast.rope.apply_rope_thd` that of packed (THD) rows with the
    positions found on the device; TransformerEngine's fused RoPE, the interleaved variant,
    packed rows split over context-parallel ranks and inference stay with megatron.
    """
    config = module.config
    if rotary_pos_emb is None:
        return "no rotary embedding"
    if config.apply_rope_fusion:
        return "apply_rope_fusion (TransformerEngine's fused RoPE)"
    if config.rotary_interleaved:
        return "rotary_interleaved"
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        if module.pg_collection.cp.size() > 1:
            return "packed sequences over context-parallel ranks (megatron's THD RoPE splits them)"
    if inference_context is not None:
        return "inference (megatron's key-value cache path)"
    return None


def mla_rope_reason(module, packed_seq_params, inference_context) -> str | None:
    """Why ``module`` (a :class:`~megatron_hybrid.modules.fast.mla.FastMLASelfAttention`) must
    leave its RoPE to megatron's ``apply_rotary_pos_emb``, or None: :func:`rope_reason`'s cases,
    and an up-projection recomputed in the backward (``recompute_up_proj``), whose recomputation
    runs megatron's RoPE outside the forward."""
    if getattr(module, "recompute_up_proj", False):
        return "recompute_up_proj (the backward recomputes the RoPE with megatron's function)"
    return rope_reason(module, module.rotary_pos_emb, packed_seq_params, inference_context)


def is_causal_mask(mask_type) -> bool:
    """Whether megatron's ``AttnMaskType`` ``mask_type`` is causal."""
    return getattr(mask_type, "name", str(mask_type)) in ("causal", "padding_causal")


# ---------------------------------------------------------------------------------------------
# Routed experts through one grouped GEMM per expert linear
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def probing_backward():
    """Autograd on for a probe that runs a backward, whatever the caller's mode: the first call
    of a fast module may come from a forward-only caller (``forward_logprobs`` under
    ``no_grad``, an engine under ``inference_mode``), and the probe's verdict is kept for the
    process, so a probe that failed there would keep the fast path off for training too."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


@functools.cache
def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> str | None:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (it came in torch 2.8)"
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu"
    try:
        with probing_backward():
            x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([8, 16], device=device, dtype=torch.int32)
            out = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
            out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return f"torch._grouped_mm does not run on {device_type} in {dtype}: {first_line}"
    return None


_PLAIN_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")


def grouped_gemm_reason(experts, hidden: torch.Tensor) -> str | None:
    """Why ``experts`` (a :class:`~megatron_hybrid.modules.fast.experts.GroupedGemmExperts`)
    must run megatron's per-expert loop on ``hidden``, or None.

    The grouped path computes each expert linear as one ``torch._grouped_mm`` over the stacked
    expert weights. It needs the plain local linears (an adapter such as LoRA that wraps them
    changes their forward; it hooks ``GroupedGemmExperts.grouped_linear`` instead), no expert
    biases, no FP8/FP4 padding, no TransformerEngine activation, 16-byte aligned rows, and a
    device and dtype ``torch._grouped_mm`` runs in (on CUDA: bf16; its CUTLASS kernel needs
    compute capability 9.x or 10.x, elsewhere torch loops over the groups itself).
    """
    config = experts.config
    if experts.num_local_experts == 1:
        return "one local expert (megatron runs it as a single MLP already)"
    if config.fp8 or config.fp4:
        return "FP8/FP4 experts (megatron pads each expert's tokens for the quantised GEMMs)"
    if config.add_bias_linear:
        return "expert biases (add_bias_linear=True)"
    if config.use_te_activation_func:
        return "TransformerEngine's activation module (use_te_activation_func=True)"
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        return "moe_apply_probs_on_input with top-k > 1 (megatron refuses it)"
    first = experts.local_experts[0]
    for name in ("linear_fc1", "linear_fc2"):
        kind = type(getattr(first, name)).__name__
        if kind not in _PLAIN_LINEARS:
            return (
                f"{name} is a {kind}, not a plain local linear: its forward may add to the "
                "weight's product (an adapter); hook GroupedGemmExperts.grouped_linear instead"
            )
    if hidden.dtype not in (torch.bfloat16, torch.float32):
        return f"tokens in {hidden.dtype} (the grouped GEMM takes bf16, or float32 on the CPU)"
    if hidden.is_cuda and hidden.dtype != torch.bfloat16:
        return f"tokens in {hidden.dtype} on CUDA (torch._grouped_mm's CUDA kernels take bf16)"
    align = 16 // hidden.element_size()
    widths = {
        "input": first.linear_fc1.weight.shape[1],
        "fc1 output": first.linear_fc1.weight.shape[0],
        "fc2 input": first.linear_fc2.weight.shape[1],
        "output": first.linear_fc2.weight.shape[0],
    }
    for what, width in widths.items():
        if width % align:
            return f"the expert {what} width {width} is not a multiple of {align} (16 bytes)"
    return _grouped_mm_probe(hidden.device.type, hidden.dtype)


# ---------------------------------------------------------------------------------------------
# Token dispatch without a host synchronisation
# ---------------------------------------------------------------------------------------------


def sync_free_dispatch_reason(dispatcher) -> str | None:
    """Why an all-to-all dispatcher must copy its token counts to the host, or None.

    With one expert-parallel and one expert-tensor-parallel rank there is no all-to-all, and
    megatron's second permutation (sorting received chunks by local expert) is the identity;
    its only host copy then serves that no-op and the per-expert loop of ``SequentialMLP``.
    Token dropping and router padding change the output size, which megatron reads on the host.
    """
    config = dispatcher.config
    if dispatcher.ep_size > 1 or dispatcher.tp_size > 1:
        return (
            f"expert parallelism {dispatcher.ep_size} x expert tensor parallelism "
            f"{dispatcher.tp_size}: the all-to-all needs its split sizes on the host"
        )
    if dispatcher.drop_and_pad or config.moe_expert_capacity_factor is not None:
        return "token dropping (moe_expert_capacity_factor): the output size is read on the host"
    if config.moe_router_padding_for_quantization:
        return "router padding for quantisation: the output size is read on the host"
    return None


def gather_permutation_reason(dispatcher) -> str | None:
    """Why an all-to-all dispatcher must permute with megatron's ``permute`` / ``unpermute``
    (an ``index_select`` whose gradient, and a ``scatter_add_``, accumulate with atomics), or
    None where :mod:`~megatron_hybrid.modules.fast.permutation`'s gathers compute the same.

    The gathers need exactly ``k`` rows per token: no token dropping, no router padding for
    quantisation. TransformerEngine's fused permutation (``moe_permute_fusion``) stays.
    """
    config = dispatcher.config
    if config.moe_permute_fusion:
        return "moe_permute_fusion (TransformerEngine's fused permutation)"
    if dispatcher.drop_and_pad or config.moe_expert_capacity_factor is not None:
        return "token dropping (moe_expert_capacity_factor): tokens keep fewer than k rows"
    if config.moe_router_padding_for_quantization:
        return "router padding for quantisation: the routing map gains padding rows"
    return None


def chunk_sort_reason(dispatcher) -> str | None:
    """Why an all-to-all dispatcher sorts the received chunks by local expert with megatron's
    ``sort_chunks_by_idxs`` (a split and a concatenation of ``ranks x local experts`` pieces),
    or None where :func:`~megatron_hybrid.modules.fast.permutation.chunk_order`'s gather
    computes the same. It applies at EP > 1 with several local experts; elsewhere there is
    nothing from other ranks to sort.
    """
    config = dispatcher.config
    if config.moe_permute_fusion:
        return "moe_permute_fusion (TransformerEngine's fused chunk sort)"
    if dispatcher.drop_and_pad or config.moe_expert_capacity_factor is not None:
        return "token dropping (moe_expert_capacity_factor): megatron's fixed-capacity transpose"
    if dispatcher.tp_size > 1:
        return (
            f"expert tensor parallelism {dispatcher.tp_size}: megatron gathers the chunks over "
            "its ranks first"
        )
    return None


# ---------------------------------------------------------------------------------------------
# GatedDeltaNet's chunked recurrence
# ---------------------------------------------------------------------------------------------


def gdn_rule_choice(config) -> tuple[str, str]:
    """Which chunked gated-delta-rule the fast GatedDeltaNet runs, and why: ``("fla", why)``
    or ``("scan", why)``.

    The choice is megatron-core's own: fla's Triton kernels unless ``deterministic_mode``
    selects the torch path, which the fast class computes with the package's parallel scan
    (:func:`~megatron_hybrid.modules.fast.gdn.scan_chunk_gated_delta_rule`) instead of
    megatron's step-by-step loop. Where fla refuses its own backward kernel (Hopper with
    Triton 3.4-3.7.0, fla #640) the package's kernel replaces it
    (:func:`~megatron_hybrid.modules.fla_backend.dqkwg_choice`).
    """
    if config.deterministic_mode:
        return "scan", "deterministic_mode selects the torch path (computed as a parallel scan)"
    backward, why = dqkwg_choice()
    return "fla", (
        "fla's Triton kernels (megatron's choice without deterministic_mode); their backward's "
        f"dq/dk/dw/dg kernel: {'the package' if backward == 'package' else 'fla'}'s ({why})"
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fast_path_report(model: torch.nn.Module) -> dict[str, Any]:
    """What each fast module of ``model`` ran in its last forward: ``{module name: "fast" or
    the reason it ran the reference forward}`` (modules not called yet report ``"not run"``)."""
    report = {}
    for name, module in model.named_modules():
        if not hasattr(module, "fast_path_reason"):
            continue
        reason = module.fast_path_reason
        report[name] = "fast" if reason is None else reason
    return report

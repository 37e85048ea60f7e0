"""Which built-in layer types accept packed (THD) input under megatron-core 0.19.2 (no torch).

The padded (BSHD) layout works for every layer type; packed input does not. RL frameworks had to
discover this per model, so the rules are written down here, one rule per built-in layer type
(each type's :class:`~megatron_hybrid.pattern.layer_types.LayerTypeFacts` holds its rule), each
citing the megatron-core 0.19.2 source it rests on (paths relative to ``megatron/core``):

``*`` attention, ``+`` MLA
    ``transformer_engine``: ``TEDotProductAttention`` forwards ``cu_seqlens_*`` and
    ``cu_seqlens_*_padded`` to TE (extensions/transformer_engine.py,
    ``TEDotProductAttention.forward``). ``local``: megatron-core's own ``DotProductAttention``
    asserts ``packed_seq_params is None`` (transformer/dot_product_attention.py, ``forward``), but
    the package's local spec builds :class:`~megatron_hybrid.modules.attention.LocalCoreAttention`
    (``MLACoreAttention`` for ``+``) instead, which runs that same attention once per packed
    sequence (block-diagonal causal, ``cu_seqlens_*_padded`` honoured). MLA's own THD handling
    (RoPE per sequence) is in transformer/multi_latent_attention.py, ``forward``. Context
    parallelism of packed batches needs TE (the local attention has none).
``D`` DeepSeek sparse attention
    ``DSAttention`` is its own core attention in both hybrid specs (hybrid_layer_specs.py) and
    handles ``qkv_format == "thd"`` itself, with and without CP/SP
    (transformer/experimental_attention_variant/dsa.py, ``DSAttention.forward``). Only the TE
    backend builds it (its indexer needs TE's plain linear layer), so ``local`` refuses it by name.
``G`` GatedDeltaNet
    Accepts THD (ssm/gated_delta_net/gdn.py, ``GatedDeltaNet.forward``; ``cu_seqlens_*_padded``
    win, their last entry must equal the packed length and every length must divide by cp:
    common.py, ``_GDNBase._resolve_cu_seqlens``), but not in deterministic mode:
    ``deterministic_mode`` selects ``torch_chunk_gated_delta_rule`` (gdn.py,
    ``GatedDeltaNet._setup_variant_attrs``), which asserts ``cu_seqlens is None`` (common.py,
    ``torch_chunk_gated_delta_rule``), and ``GatedDeltaNet.forward`` asserts "Packed sequence does
    not support deterministic mode." Outside deterministic mode megatron passes
    ``cu_seqlens`` to fla's ``causal_conv1d`` and ``chunk_gated_delta_rule``, which restart the
    conv window and the recurrent state at every boundary on GPUs; the package's CPU runtime
    gives megatron torch stand-ins with that contract (:mod:`megatron_hybrid.modules.gdn_torch`)
    instead of switching deterministic mode on, so the CPU packs too.
``M`` Mamba
    Accepts THD in training only on the memory-efficient path: with
    ``use_mamba_mem_eff_path=False`` it asserts "Training with packed sequences is not supported
    in the non-memory-efficient code path." (ssm/mamba_mixer.py, ``MambaMixer.forward``). It
    needs ``causal_conv1d >= 1.4.0`` and ``mamba_ssm >= 2.0.0`` (mamba_mixer.py,
    ``MambaMixer._ssm_training`` and ``_check_mamba_sequence_packing_support``) and
    ``packed_seq_params.seq_idx``, which ``PackedSeqParams.__post_init__`` builds only when
    ``total_tokens`` is set (packed_seq_params.py; our packer always sets it). With cp > 1 it
    partitions through TE's ``thd_get_partitioned_indices`` and asserts TE >= 1.10
    (ssm/mamba_context_parallel.py, ``_undo_attention_load_balancing`` and
    ``_redo_attention_load_balancing``), so CP needs TransformerEngine. The
    package's torch Mamba2 path (``modules/mamba_torch.py``, used where mamba_ssm cannot run)
    reads the same ``seq_idx`` and restarts its conv and scan at every sequence start; the
    ``use_mamba_mem_eff_path`` rule above is the kernels' and is kept for both paths.
``-`` MLP, ``E`` MoE
    Token-wise; the layout does not matter (MoE reads ``padding_mask`` to ignore pads).

A registered layer type that names no rule gets :func:`unchecked_thd`, which refuses packed input
until someone has checked the type and given it a rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ThdOptions",
    "ThdRule",
    "accepts_thd",
    "gated_delta_net_thd",
    "mamba_thd",
    "core_attention_thd",
    "dsa_thd",
    "unchecked_thd",
]


@dataclass(frozen=True, kw_only=True)
class ThdOptions:
    """The settings that decide THD support (names as in ``TransformerConfig``).

    Attributes:
        transformer_impl: ``"local"``, ``"transformer_engine"`` or ``"inference_optimized"``.
        deterministic_mode: ``TransformerConfig.deterministic_mode``.
        cp_size: context-parallel size.
        use_mamba_mem_eff_path: ``TransformerConfig.use_mamba_mem_eff_path``.
    """

    transformer_impl: str = "transformer_engine"
    deterministic_mode: bool = False
    cp_size: int = 1
    use_mamba_mem_eff_path: bool = True


#: ``(options) -> reason`` (one sentence citing upstream and saying the fix) or None: accepted.
ThdRule = Callable[[ThdOptions], "str | None"]


def accepts_thd(opts: ThdOptions) -> str | None:
    """The rule of a token-wise layer or one that handles THD itself: always accepted."""
    return None


def unchecked_thd(opts: ThdOptions) -> str | None:
    """The default rule of a registered type: refused until someone checks the type."""
    return (
        "this registered layer type was not checked for packed (THD) input; give its "
        "LayerTypeFacts a thd_rule (megatron_hybrid.pattern.thd_rules.accepts_thd if it is "
        "token-wise or handles cu_seqlens itself)"
    )


def core_attention_thd(name: str, symbol: str) -> ThdRule:
    """The rule of an attention type whose core attention packs on ``local`` and ``te``."""

    def check(opts: ThdOptions) -> str | None:
        if opts.transformer_impl == "transformer_engine":
            return None
        if opts.transformer_impl == "local":
            if opts.cp_size > 1:
                return (
                    f"{name} ('{symbol}') with transformer_impl='local' has no context "
                    "parallelism (megatron-core's DotProductAttention and the package's "
                    "LocalCoreAttention refuse cp > 1); use transformer_impl='transformer_engine'"
                )
            return None
        return f"{name} ('{symbol}') was not checked for THD with {opts.transformer_impl!r}"

    return check


def dsa_thd(opts: ThdOptions) -> str | None:
    """DeepSeek sparse attention (``D``): packs wherever it is built (the TE backend)."""
    if opts.transformer_impl == "transformer_engine":
        return None
    return (
        f"DeepSeek sparse attention ('D') is built only by the TE backend in megatron-core "
        f"0.19.2 (its indexer needs TE's plain linear layer), not with "
        f"transformer_impl={opts.transformer_impl!r}; use transformer_impl='transformer_engine'"
    )


def gated_delta_net_thd(opts: ThdOptions) -> str | None:
    """GatedDeltaNet (``G``): accepted except in deterministic mode."""
    if opts.deterministic_mode:
        return (
            "GatedDeltaNet ('G') in deterministic mode runs torch_chunk_gated_delta_rule, which "
            "takes no cu_seqlens (megatron/core/ssm/gated_delta_net/common.py, "
            "torch_chunk_gated_delta_rule; GatedDeltaNet.forward in gdn.py asserts 'Packed "
            "sequence does not support deterministic mode.'); turn deterministic_mode off"
        )
    return None


def mamba_thd(opts: ThdOptions) -> str | None:
    """Mamba (``M``): the memory-efficient path only, and TE for cp > 1."""
    if not opts.use_mamba_mem_eff_path:
        return (
            "Mamba ('M') trains packed sequences only on the memory-efficient path "
            "(megatron/core/ssm/mamba_mixer.py, MambaMixer.forward); drop "
            "--disable-mamba-mem-eff-path"
        )
    if opts.cp_size > 1 and opts.transformer_impl != "transformer_engine":
        return (
            "Mamba ('M') with cp > 1 partitions packed sequences with TransformerEngine's "
            "thd_get_partitioned_indices (megatron/core/ssm/mamba_context_parallel.py, "
            "_undo_attention_load_balancing); use "
            "transformer_impl='transformer_engine'"
        )
    return None

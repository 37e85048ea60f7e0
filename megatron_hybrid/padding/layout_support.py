"""Which layer types accept packed (THD) input under megatron-core 0.19.2.

The padded (BSHD) layout works for every layer type; packed input does not. RL frameworks had to
discover this per model, so the rules are written down here, one checker per pattern symbol,
each citing the megatron-core 0.19.2 source lines it rests on (paths relative to
``megatron/core``):

``*`` attention
    ``local``: ``DotProductAttention.forward`` asserts ``packed_seq_params is None``
    ("Packed sequence is not supported by DotProductAttention. Please use TEDotProductAttention
    instead.", transformer/dot_product_attention.py L153-156). ``transformer_engine``:
    ``TEDotProductAttention`` forwards ``cu_seqlens_*``/``cu_seqlens_*_padded`` to TE
    (extensions/transformer_engine.py L1920-1945, L1980-2037).
``+`` MLA
    Same core attention as ``*``: the local spec's ``DotProductAttention`` refuses THD, the TE
    spec's ``TEDotProductAttention`` accepts it (models/hybrid/hybrid_layer_specs.py L185/L302;
    MLA's own THD handling: transformer/multi_latent_attention.py L702-730).
``D`` DeepSeek sparse attention
    ``DSAttention`` is its own core attention in both hybrid specs (hybrid_layer_specs.py
    L137-160, L254-280) and handles ``qkv_format == "thd"`` itself, with and without CP/SP
    (transformer/experimental_attention_variant/dsa.py L1716-1800). Accepted.
``G`` GatedDeltaNet
    Accepts THD (ssm/gated_delta_net/gdn.py L95-127; ``cu_seqlens_*_padded`` win, their last
    entry must equal the packed length and every length must divide by cp: common.py
    L448-472), but not in deterministic mode: ``deterministic_mode`` selects
    ``torch_chunk_gated_delta_rule`` (gdn.py L59-62), which asserts ``cu_seqlens is None``
    (common.py L821-823), and ``forward`` asserts "Packed sequence does not support
    deterministic mode." (gdn.py L97-99).
``M`` Mamba
    Accepts THD in training only on the memory-efficient path: with
    ``use_mamba_mem_eff_path=False`` it asserts "Training with packed sequences is not supported
    in the non-memory-efficient code path." (ssm/mamba_mixer.py L502-507). It needs
    ``causal_conv1d >= 1.4.0`` and ``mamba_ssm >= 2.0.0`` (mamba_mixer.py L745-750,
    L1490-1506) and ``packed_seq_params.seq_idx``, which ``PackedSeqParams.__post_init__``
    builds only when ``total_tokens`` is set (packed_seq_params.py L30-70; our packer always sets
    it). With cp > 1 it partitions through TE's ``thd_get_partitioned_indices`` and asserts
    TE >= 1.10 (ssm/mamba_context_parallel.py L377-380), so CP needs TransformerEngine. The
    package's torch Mamba2 path (``modules/mamba_torch.py``, used where mamba_ssm cannot run)
    reads the same ``seq_idx`` and restarts its conv and scan at every sequence start; the
    ``use_mamba_mem_eff_path`` rule above is the kernels' and is kept for both paths.
``-`` MLP, ``E`` MoE
    Token-wise; the layout does not matter (MoE reads ``padding_mask`` to ignore pads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from megatron_hybrid.pattern.symbols import ATTENTION, DSA, GDN, MAMBA, MLA, MLP, MOE

__all__ = ["THD_CHECKS", "ThdOptions", "thd_unsupported_reason", "thd_unsupported_reason_for"]

_IMPLS = ("local", "transformer_engine", "inference_optimized")


@dataclass(frozen=True, kw_only=True)
class ThdOptions:
    """The settings that decide THD support (names as in ``TransformerConfig``)."""

    transformer_impl: str = "transformer_engine"
    deterministic_mode: bool = False
    cp_size: int = 1
    use_mamba_mem_eff_path: bool = True


def _te_core_attention(name: str, symbol: str) -> Callable[[ThdOptions], str | None]:
    def check(opts: ThdOptions) -> str | None:
        if opts.transformer_impl == "transformer_engine":
            return None
        if opts.transformer_impl == "local":
            return (
                f"{name} ('{symbol}') with transformer_impl='local' uses megatron-core's "
                "DotProductAttention, which asserts packed_seq_params is None "
                "(transformer/dot_product_attention.py L153-156); use transformer_impl="
                "'transformer_engine'"
            )
        return f"{name} ('{symbol}') was not checked for THD with {opts.transformer_impl!r}"

    return check


def _gated_delta_net(opts: ThdOptions) -> str | None:
    if opts.deterministic_mode:
        return (
            "GatedDeltaNet ('G') in deterministic mode runs torch_chunk_gated_delta_rule, which "
            "takes no cu_seqlens (ssm/gated_delta_net/common.py L821-823; gdn.py L97-99 asserts "
            "'Packed sequence does not support deterministic mode.'); turn deterministic_mode off"
        )
    return None


def _mamba(opts: ThdOptions) -> str | None:
    if not opts.use_mamba_mem_eff_path:
        return (
            "Mamba ('M') trains packed sequences only on the memory-efficient path "
            "(ssm/mamba_mixer.py L502-507); drop --disable-mamba-mem-eff-path"
        )
    if opts.cp_size > 1 and opts.transformer_impl != "transformer_engine":
        return (
            "Mamba ('M') with cp > 1 partitions packed sequences with TransformerEngine's "
            "thd_get_partitioned_indices (ssm/mamba_context_parallel.py L377-380); use "
            "transformer_impl='transformer_engine'"
        )
    return None


def _always(opts: ThdOptions) -> str | None:
    return None


# One checker per pattern symbol; a new layer type registers here rather than in an if/elif.
THD_CHECKS: Mapping[str, Callable[[ThdOptions], str | None]] = MappingProxyType(
    {
        ATTENTION: _te_core_attention("attention", ATTENTION),
        MLA: _te_core_attention("MLA", MLA),
        DSA: _always,
        GDN: _gated_delta_net,
        MAMBA: _mamba,
        MLP: _always,
        MOE: _always,
    }
)


def thd_unsupported_reason(
    symbols: Iterable[str],
    *,
    transformer_impl: str = "transformer_engine",
    deterministic_mode: bool = False,
    cp_size: int = 1,
    use_mamba_mem_eff_path: bool = True,
) -> str | None:
    """Say why packed (THD) input is not allowed for these layer types, or return None.

    Args:
        symbols: the layer symbols of the model's pattern (any iterable of one-character
            strings, e.g. a pattern's canonical string or the set of its symbols; brackets and
            the ``|``/``/`` separators are ignored).
        transformer_impl: ``"local"``, ``"transformer_engine"`` or ``"inference_optimized"``.
        deterministic_mode: ``TransformerConfig.deterministic_mode``.
        cp_size: context-parallel size.
        use_mamba_mem_eff_path: ``TransformerConfig.use_mamba_mem_eff_path``.

    Returns:
        None when every layer type accepts THD, else one sentence per refusing layer type,
        joined with "; ", each citing megatron-core 0.19.2 and saying how to fix it.

    Raises:
        ValueError: an unknown symbol or ``transformer_impl``.

    >>> thd_unsupported_reason("[GE][*E]") is None
    True
    >>> print(thd_unsupported_reason({"G", "E"}, deterministic_mode=True)[:60])
    GatedDeltaNet ('G') in deterministic mode runs torch_chunk_g
    """
    if transformer_impl not in _IMPLS:
        raise ValueError(f"transformer_impl must be one of {_IMPLS}, got {transformer_impl!r}")
    opts = ThdOptions(
        transformer_impl=transformer_impl,
        deterministic_mode=bool(deterministic_mode),
        cp_size=int(cp_size),
        use_mamba_mem_eff_path=bool(use_mamba_mem_eff_path),
    )
    seen: list[str] = []
    for symbol in symbols:
        if symbol in "[]()|/" or symbol in seen:
            continue
        if symbol not in THD_CHECKS:
            raise ValueError(
                f"unknown layer symbol {symbol!r}; expected one of {''.join(THD_CHECKS)}"
            )
        seen.append(symbol)
    reasons = [r for r in (THD_CHECKS[s](opts) for s in sorted(seen)) if r is not None]
    return "; ".join(reasons) or None


def thd_unsupported_reason_for(symbols: Iterable[str], config: Any) -> str | None:
    """:func:`thd_unsupported_reason` with the options read from a ``TransformerConfig``."""
    return thd_unsupported_reason(
        symbols,
        transformer_impl=getattr(config, "transformer_impl", "transformer_engine"),
        deterministic_mode=getattr(config, "deterministic_mode", False),
        cp_size=getattr(config, "context_parallel_size", 1),
        use_mamba_mem_eff_path=getattr(config, "use_mamba_mem_eff_path", True),
    )

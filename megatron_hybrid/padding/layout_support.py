"""Which layer types accept packed (THD) input under megatron-core 0.19.2.

The padded (BSHD) layout works for every layer type; packed input does not. Each layer type's
rule is a fact of its record in the layer-type table (``LayerTypeFacts.thd_rule``; the built-in
rules and the megatron-core sources they rest on are in
:mod:`megatron_hybrid.pattern.thd_rules`). This module applies the rules of a pattern's symbols
to one set of settings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from megatron_hybrid.pattern.layer_types import LAYER_TYPES, layer_symbols
from megatron_hybrid.pattern.thd_rules import ThdOptions

__all__ = ["THD_CHECKS", "ThdOptions", "thd_unsupported_reason", "thd_unsupported_reason_for"]

_IMPLS = ("local", "transformer_engine", "inference_optimized")


class _ThdChecks(Mapping[str, Callable[[ThdOptions], "str | None"]]):
    """Symbol -> THD rule: a read-only, live view of the layer-type table."""

    def __getitem__(self, symbol: str) -> Callable[[ThdOptions], str | None]:
        return LAYER_TYPES[symbol].thd_rule

    def __iter__(self):
        return iter(layer_symbols())

    def __len__(self) -> int:
        return len(LAYER_TYPES)


#: One checker per pattern symbol, read from the layer-type table (kept under its old name).
THD_CHECKS: Mapping[str, Callable[[ThdOptions], str | None]] = _ThdChecks()


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

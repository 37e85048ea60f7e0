"""The layer-type table: one frozen record of pure facts per pattern symbol (no torch).

Everything the package knows about a layer type without building it lives in its
:class:`LayerTypeFacts`: the symbol, a human name, the group slot, the role it plays in a GPT
layer, whether it accepts packed (THD) input and the colour ``describe --png`` draws it in. The
parser, ``describe``, the THD check and the GPT-equivalence rules read this table and nothing else,
so a new layer type is a new record (plus its runtime part, see
``megatron_hybrid.modules.layer_types``), not an edit in each of them.

The table is live: :func:`register_layer_facts` extends the alphabet the parser accepts and
:func:`unregister_layer_facts` takes a registered type away again (the built-in types cannot be
removed). Caches keyed on patterns use :func:`alphabet_version`, which changes on every
registration, so a pattern is never read with a stale alphabet.

>>> layer_facts("E").name, layer_facts("E").slot, layer_facts("E").gpt_role
('MoE', <Slot.MLP: 'mlp'>, <GptRole.MLP: 'mlp'>)
>>> layer_symbols()
('M', 'G', '*', 'D', '+', '-', 'E')
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from megatron_hybrid.pattern.symbols import (
    ATTENTION,
    DSA,
    GDN,
    GROUP_CLOSE,
    GROUP_OPEN,
    MAMBA,
    MLA,
    MLP,
    MOE,
    MTP_SEPARATOR,
    PIPE,
    REPEAT_CLOSE,
    REPEAT_OPEN,
    RUN_CLOSE,
    RUN_OPEN,
    Slot,
)
from megatron_hybrid.pattern.thd_rules import (
    ThdOptions,
    ThdRule,
    accepts_thd,
    core_attention_thd,
    dsa_thd,
    gated_delta_net_thd,
    mamba_thd,
    unchecked_thd,
)

__all__ = [
    "LAYER_TYPES",
    "SLOT_OF_SYMBOL",
    "SYMBOL_NAMES",
    "GptRole",
    "LayerTypeFacts",
    "ThdOptions",
    "alphabet_version",
    "layer_facts",
    "layer_symbols",
    "register_layer_facts",
    "unregister_layer_facts",
]


class GptRole(StrEnum):
    """The half of a GPT ``TransformerLayer`` a layer type is exactly equivalent to.

    A group of one ``ATTENTION``-role member followed by one ``MLP``-role member has the
    parameters and keys of a GPT layer (``docs/architecture.md``, "Guarantees and targets").
    """

    ATTENTION = "attention"
    MLP = "mlp"


_COLOUR = re.compile(r"#[0-9A-Fa-f]{6}")
_STRUCTURE = frozenset(
    (GROUP_OPEN, GROUP_CLOSE, RUN_OPEN, RUN_CLOSE, REPEAT_OPEN, REPEAT_CLOSE, PIPE, MTP_SEPARATOR)
)


@dataclass(frozen=True, kw_only=True)
class LayerTypeFacts:
    """The pure facts of one layer type.

    Attributes:
        symbol: the one-character pattern symbol.
        name: human name, used in messages, ``describe`` and the docs.
        slot: the place the type takes in a group (at most one member per slot).
        gpt_role: the GPT-layer half the type is exactly equivalent to, or None when GPTModel has
            no counterpart (then groups holding it use the indexed key form).
        thd_rule: ``(ThdOptions) -> reason or None``: why packed (THD) input is refused under
            those settings, citing megatron-core, or None when it is accepted.
        colour: ``#RRGGBB`` colour of the type in ``describe --png``.
    """

    symbol: str
    name: str
    slot: Slot
    gpt_role: GptRole | None = None
    thd_rule: ThdRule = field(default=unchecked_thd)
    colour: str = "#999999"

    def check(self) -> None:
        """Raise ``ValueError`` naming the field that cannot be registered and how to fix it."""
        symbol = self.symbol
        if not isinstance(symbol, str) or len(symbol) != 1:
            raise ValueError(f"a layer symbol is one character, got {symbol!r}")
        if symbol in _STRUCTURE or symbol.isspace() or symbol.isdigit() or symbol.islower():
            raise ValueError(
                f"{symbol!r} cannot be a layer symbol: digits, lower-case letters, whitespace "
                f"and the structure characters {''.join(sorted(_STRUCTURE))} are reserved; "
                "pick an upper-case letter or a punctuation mark"
            )
        if not isinstance(self.slot, Slot):
            raise ValueError(f"slot of {symbol!r} must be a Slot, got {self.slot!r}")
        expected_slot = {GptRole.ATTENTION: Slot.ATTENTION, GptRole.MLP: Slot.MLP}
        if self.gpt_role is not None and expected_slot[self.gpt_role] != self.slot:
            raise ValueError(
                f"{symbol!r} has gpt_role {self.gpt_role.value!r} but slot {self.slot.value!r}; "
                f"a GPT {self.gpt_role.value} half takes the {expected_slot[self.gpt_role].value} "
                "slot"
            )
        if not self.name:
            raise ValueError(f"layer type {symbol!r} needs a name")
        if not callable(self.thd_rule):
            raise ValueError(f"thd_rule of {symbol!r} must be callable (ThdOptions -> str | None)")
        if not _COLOUR.fullmatch(self.colour):
            raise ValueError(f"colour of {symbol!r} must look like '#1f77b4', got {self.colour!r}")


# Okabe-Ito palette (colour-blind safe) for the built-in types.
_BUILTIN = (
    LayerTypeFacts(
        symbol=MAMBA, name="Mamba", slot=Slot.MIXER, thd_rule=mamba_thd, colour="#0072B2"
    ),
    # GatedDeltaNet takes the attention slot because megatron-core builds it as a
    # TransformerLayer's ``self_attention`` (its checkpoint keys live there too); GPTModel has
    # no such layer, so it has no GPT role.
    LayerTypeFacts(
        symbol=GDN,
        name="GatedDeltaNet",
        slot=Slot.ATTENTION,
        thd_rule=gated_delta_net_thd,
        colour="#56B4E9",
    ),
    LayerTypeFacts(
        symbol=ATTENTION,
        name="attention",
        slot=Slot.ATTENTION,
        gpt_role=GptRole.ATTENTION,
        thd_rule=core_attention_thd("attention", ATTENTION),
        colour="#E69F00",
    ),
    LayerTypeFacts(
        symbol=DSA,
        name="DeepSeek sparse attention",
        slot=Slot.ATTENTION,
        gpt_role=GptRole.ATTENTION,
        thd_rule=dsa_thd,
        colour="#D55E00",
    ),
    LayerTypeFacts(
        symbol=MLA,
        name="MLA",
        slot=Slot.ATTENTION,
        gpt_role=GptRole.ATTENTION,
        thd_rule=core_attention_thd("MLA", MLA),
        colour="#CC79A7",
    ),
    LayerTypeFacts(
        symbol=MLP,
        name="dense MLP",
        slot=Slot.MLP,
        gpt_role=GptRole.MLP,
        thd_rule=accepts_thd,
        colour="#009E73",
    ),
    LayerTypeFacts(
        symbol=MOE,
        name="MoE",
        slot=Slot.MLP,
        gpt_role=GptRole.MLP,
        thd_rule=accepts_thd,
        colour="#F0E442",
    ),
)
_BUILTIN_SYMBOLS = frozenset(facts.symbol for facts in _BUILTIN)

# The tables below are the only mutable state; every public view of them is read-only.
_facts: dict[str, LayerTypeFacts] = {facts.symbol: facts for facts in _BUILTIN}
_names: dict[str, str] = {}
_slots: dict[str, Slot] = {}
_version = [0]

#: Symbol -> LayerTypeFacts, in registration order (built-ins first). Read-only and live.
LAYER_TYPES: MappingProxyType[str, LayerTypeFacts] = MappingProxyType(_facts)
#: Symbol -> human name (read-only, live view of the table).
SYMBOL_NAMES: MappingProxyType[str, str] = MappingProxyType(_names)
#: Symbol -> group slot (read-only, live view of the table).
SLOT_OF_SYMBOL: MappingProxyType[str, Slot] = MappingProxyType(_slots)


def _refresh() -> None:
    _names.clear()
    _names.update((s, f.name) for s, f in _facts.items())
    _slots.clear()
    _slots.update((s, f.slot) for s, f in _facts.items())
    _version[0] += 1


_refresh()


def alphabet_version() -> int:
    """A number that changes whenever the table does (a cache key for parsed patterns)."""
    return _version[0]


def layer_symbols() -> tuple[str, ...]:
    """Every layer symbol the parser accepts now, built-ins first, in registration order."""
    return tuple(_facts)


def layer_facts(symbol: str) -> LayerTypeFacts:
    """The facts of ``symbol``.

    Raises:
        ValueError: no layer type has that symbol.
    """
    try:
        return _facts[symbol]
    except KeyError:
        raise ValueError(
            f"no layer type has the symbol {symbol!r}; known: {' '.join(_facts)} (add one with "
            "megatron_hybrid.modules.register_layer_type)"
        ) from None


def register_layer_facts(facts: LayerTypeFacts) -> None:
    """Add a layer type's facts; the parser accepts its symbol from now on.

    Most callers want ``megatron_hybrid.modules.register_layer_type``, which registers the
    runtime part (spec, build, schedule pieces) together with these facts.

    Raises:
        ValueError: the symbol is taken or a field is invalid.
    """
    if not isinstance(facts, LayerTypeFacts):
        raise ValueError(f"expected LayerTypeFacts, got {type(facts).__name__}")
    facts.check()
    if facts.symbol in _facts:
        raise ValueError(
            f"the layer symbol {facts.symbol!r} is already taken by "
            f"{_facts[facts.symbol].name}; pick another character"
        )
    _facts[facts.symbol] = facts
    _refresh()


def unregister_layer_facts(symbol: str) -> None:
    """Remove a registered layer type (the built-in types stay).

    Raises:
        ValueError: ``symbol`` is built in or not registered.
    """
    if symbol in _BUILTIN_SYMBOLS:
        raise ValueError(f"the built-in layer type {symbol!r} cannot be unregistered")
    layer_facts(symbol)  # raises for an unknown symbol
    del _facts[symbol]
    _refresh()

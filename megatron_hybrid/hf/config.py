"""Hugging Face ``config.json`` -> megatron ``TransformerConfig``, pattern and model arguments.

Each family (``megatron_hybrid.hf.families``) reads the fields it maps and declares the ones it
knowingly leaves out (token ids, cache switches, initialisation ranges: nothing that changes the
forward math). Any other field is *unsupported*: it is reported by name, and loading refuses it
unless the caller names it in ``ignore_config_fields``, so no knob that changes the math is
dropped silently (``routed_scaling_factor``, ``n_group``, ``topk_group`` and the like are mapped).

Registration runs one way: each family module imports this one and calls :func:`register_family`
when it is imported, and the ``megatron_hybrid.hf`` package imports the families, so any import
of this module has them registered and this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_hybrid.hf.fp8 import BlockFP8, UnsupportedQuantizationError, block_fp8_format
from megatron_hybrid.hf.io import HFCheckpoint
from megatron_hybrid.pattern import ParsedPattern

__all__ = [
    "FAMILIES",
    "Family",
    "HFConfigError",
    "HFConversion",
    "conversion_for",
    "convert_config",
    "family_for",
    "family_named",
    "hf_config_to_megatron",
    "register_family",
]

#: Fields no family maps because they do not change the forward math.
COMMON_IGNORED = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "output_router_logits",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_name_or_path",
        "_attn_implementation_autoset",
        "attn_implementation",
        "pretraining_tp",
        "auto_map",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tie_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "use_sliding_window",
    }
)

#: Fields read outside the family tables: ``quantization_config`` by ``megatron_hybrid.hf.fp8``.
HANDLED_FIELDS = frozenset({"quantization_config"})

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFConfigError(ValueError):
    """A Hugging Face config that cannot be converted, with the fields at fault."""


@dataclass
class HFConversion:
    """Everything needed to build the megatron twin of a Hugging Face model.

    Attributes:
        family: family name (``qwen3_5_moe``, ...).
        hf_config: the (text) config dict the conversion came from.
        config_kwargs: ``TransformerConfig`` fields, parallel sizes excluded.
        mla: whether the config is an ``MLATransformerConfig``.
        pattern: the hybrid layer pattern.
        model_kwargs: ``HybridModel`` arguments (vocab size, RoPE, tied embeddings, ...).
        hf_prefix: prefix of the decoder's on-disk names (``model.``, ``backbone.``, ...).
        dtype: the checkpoint's dtype (``torch_dtype``/``dtype``), float32 if not given.
        mtp_layers: MTP depths in the pattern.
        unsupported: ``(field, reason)`` of config fields that cannot be mapped.
        notes: things a user should know (e.g. MTP declared but absent).
        mamba_mixer_params: arguments of the torch Mamba2 mixer that reproduce the family's
            Mamba numerics (``dt_limit``, ``norm_eps``); empty for families without Mamba.
        quantization: the checkpoint's block-scaled FP8 format (None: not quantized).
        source_config: the whole config.json (a multimodal one with its ``text_config`` and
            ``vision_config``); None when it is ``hf_config``.
    """

    family: str
    hf_config: dict
    config_kwargs: dict
    mla: bool
    pattern: ParsedPattern
    model_kwargs: dict
    hf_prefix: str
    dtype: torch.dtype
    mtp_layers: int = 0
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mamba_mixer_params: dict = field(default_factory=dict)
    quantization: BlockFP8 | None = None
    source_config: dict | None = None

    @property
    def config_json(self) -> dict:
        """The config.json the conversion came from (multimodal ones whole)."""
        return self.source_config if self.source_config is not None else self.hf_config

    def transformer_config(self, **overrides: Any):
        """The ``TransformerConfig`` (or ``MLATransformerConfig``) with ``overrides`` applied."""
        from megatron.core.transformer import MLATransformerConfig, TransformerConfig

        cls = MLATransformerConfig if self.mla else TransformerConfig
        return cls(**{**self.config_kwargs, **overrides})


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family.

    Attributes:
        name: family name.
        model_types: ``model_type`` values of its config.json.
        to_megatron: ``(text config dict, mtp) -> HFConversion``; ``mtp`` is None (use the
            checkpoint's MTP tensors when the config declares them), True or False.
        plan: ``(PlanBuilder, HFConversion) -> None``: adds the weight links.
        to_hf_config: ``(HFConversion) -> dict``: a config.json transformers loads.
        text_prefixes: prefixes of the decoder names, tried in order (``model.``,
            ``model.language_model.``): the first that the checkpoint uses wins.
        fp8_unquantized: modules the family's official FP8 release leaves unquantized
            (``modules_to_not_convert`` patterns); every other 2-D ``.weight`` is FP8 under
            ``quantize="fp8"``. None: the family has no block-scaled FP8 release to follow.
        carried_parts: ``(config.json key, tensor name prefix)`` of the parts of a release
            that the hybrid model does not compute (the vision tower of a multimodal Qwen3.5
            under ``vision_config``): their tensors are carried through untouched.
        module_prefix: the prefix transformers' modules have in memory where it differs from
            the on-disk one (Nemotron-H: ``model.`` for ``backbone.``); None: the same.
    """

    name: str
    model_types: tuple[str, ...]
    to_megatron: Callable[..., HFConversion]
    plan: Callable[..., None]
    to_hf_config: Callable[[HFConversion], dict]
    text_prefixes: tuple[str, ...] = ("model.",)
    fp8_unquantized: tuple[str, ...] | None = None
    carried_parts: tuple[tuple[str, str], ...] = ()
    module_prefix: str | None = None

    def carried_prefixes(self, config_json: dict) -> tuple[str, ...]:
        """Name prefixes of the parts a config.json declares (see ``carried_parts``)."""
        return tuple(prefix for key, prefix in self.carried_parts if key in config_json)

    def module_name(self, name: str, hf_prefix: str) -> str:
        """transformers' in-memory name of the on-disk tensor or module ``name``."""
        if self.module_prefix is not None and name.startswith(hf_prefix):
            return self.module_prefix + name[len(hf_prefix) :]
        return name


#: model_type -> Family.
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> None:
    """Register a family under each of its ``model_types``."""
    for model_type in family.model_types:
        if model_type in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is already registered")
        FAMILIES[model_type] = family


def family_named(name: str) -> Family:
    """The registered family called ``name`` (an ``HFConversion.family``)."""
    for family in FAMILIES.values():
        if family.name == name:
            return family
    raise HFConfigError(f"no Hugging Face family {name!r} is registered")


def family_for(hf_config: dict) -> Family:
    """The family of a config.json dict.

    Raises:
        HFConfigError: unknown ``model_type``.
    """
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise HFConfigError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(FAMILIES))} (docs/hf_checkpoints.md)"
        )
    return FAMILIES[model_type]


def text_config(hf_config: dict) -> dict:
    """The text model's config: ``text_config`` of a multimodal config, else the config."""
    text = hf_config.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        for key in ("tie_word_embeddings", "torch_dtype", "dtype"):
            if key in hf_config and key not in merged:
                merged[key] = hf_config[key]
        return merged
    return dict(hf_config)


def convert_config(
    hf_config: dict,
    *,
    mtp: bool | None = None,
    has_tensor: Callable[[str], bool] | None = None,
) -> HFConversion:
    """The family's translation of a config.json dict, its unsupported fields listed in
    ``conversion.unsupported`` rather than refused (``dry_run`` reports them); a
    ``quantization_config`` other than block-scaled FP8 is one of them.

    Raises:
        HFConfigError: the family is unknown, a required field is missing, or a field has a
            value of the wrong kind (one message, naming it).
    """
    family = family_for(hf_config)
    try:
        conversion = family.to_megatron(text_config(hf_config), mtp=mtp, has_tensor=has_tensor)
    except HFConfigError as error:
        raise HFConfigError(f"the {family.name} config cannot be converted: {error}") from None
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as error:
        raise HFConfigError(
            f"the {family.name} config has a field of the wrong kind or value "
            f"({type(error).__name__}: {error}); is config.json complete and unedited?"
        ) from None
    if isinstance(hf_config.get("text_config"), dict):
        conversion.source_config = hf_config
    try:
        conversion.quantization = block_fp8_format(hf_config)
    except UnsupportedQuantizationError as error:
        conversion.unsupported.append(("quantization_config", str(error)))
    return conversion


def hf_config_to_megatron(
    hf_config: dict,
    *,
    mtp: bool | None = None,
    ignore_config_fields: Iterable[str] = (),
    has_tensor: Callable[[str], bool] | None = None,
) -> HFConversion:
    """Translate a config.json dict.

    Args:
        hf_config: the config dict (multimodal configs: their ``text_config`` is used).
        mtp: include the MTP layers the config declares (None: when ``has_tensor`` finds them).
        ignore_config_fields: unsupported fields to accept anyway (the caller takes the risk).
        has_tensor: ``name -> bool`` over the checkpoint's tensors (to detect MTP weights).

    Raises:
        HFConfigError: the family is unknown or a field cannot be mapped (message names it).
    """
    family = family_for(hf_config)
    conversion = convert_config(hf_config, mtp=mtp, has_tensor=has_tensor)
    # A quantization the package cannot read would load wrong values: never ignorable.
    ignored = set(ignore_config_fields) - HANDLED_FIELDS
    conversion.unsupported = [(k, m) for k, m in conversion.unsupported if k not in ignored]
    if conversion.unsupported:
        lines = "\n".join(f"  {k}: {m}" for k, m in conversion.unsupported)
        raise HFConfigError(
            f"the {family.name} config has fields that cannot be mapped onto megatron_hybrid:\n"
            f"{lines}\nthe conversion would change the model's math; pass "
            "ignore_config_fields=[...] (CLI: --ignore-hf-config-field NAME) only if you know "
            "a field does not matter"
        )
    return conversion


def conversion_for(source, *, mtp: bool | None = None, ignore_config_fields=()) -> HFConversion:
    """The :class:`HFConversion` of a Hugging Face folder (or an open ``HFCheckpoint``).

    Raises:
        HFConfigError: the family is unknown or a config field cannot be mapped.
    """
    source = source if isinstance(source, HFCheckpoint) else HFCheckpoint(source)
    conversion = hf_config_to_megatron(
        source.config,
        mtp=mtp,
        ignore_config_fields=ignore_config_fields,
        has_tensor=lambda name: name in source,
    )
    family = family_named(conversion.family)
    for prefix in family.text_prefixes:
        if f"{prefix}embed_tokens.weight" in source or f"{prefix}embeddings.weight" in source:
            conversion.hf_prefix = prefix
            break
    return conversion


class ConfigReader:
    """Reads a config dict field by field and records what was used, for the refusal rule."""

    def __init__(self, config: dict, ignored: Iterable[str] = ()) -> None:
        self.config = config
        self.used: set[str] = set(COMMON_IGNORED) | HANDLED_FIELDS | set(ignored)
        self.unsupported: list[tuple[str, str]] = []

    def get(self, name: str, default: Any = None) -> Any:
        """A field (recorded as used)."""
        self.used.add(name)
        return self.config.get(name, default)

    def require(self, name: str, default: Any = None) -> Any:
        """A field that must be present.

        Raises:
            HFConfigError: it is missing (nothing can be derived without it).
        """
        self.used.add(name)
        value = self.config.get(name, default)
        if value is None:
            raise HFConfigError(f"config.json has no {name!r}, which the model needs")
        return value

    def expect(self, name: str, allowed: Iterable[Any], default: Any = None, why: str = "") -> Any:
        """A field that must take one of ``allowed`` values."""
        value = self.get(name, default)
        allowed = list(allowed)
        if value not in allowed:
            self.unsupported.append(
                (name, f"{value!r} is not supported (supported: {allowed!r}){why}")
            )
        return value

    def dtype(self) -> torch.dtype:
        """The checkpoint dtype (``dtype`` or ``torch_dtype``), float32 if absent."""
        name = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        if name not in _DTYPES:
            self.unsupported.append(("dtype", f"{name!r} is not one of {sorted(_DTYPES)}"))
            return torch.float32
        return _DTYPES[name]

    def finish(self) -> list[tuple[str, str]]:
        """Unsupported fields: those refused plus any field nobody read."""
        unread = sorted(k for k in self.config if k not in self.used)
        return self.unsupported + [(k, "is not mapped by this converter") for k in unread]


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's name of a dtype."""
    return {v: k for k, v in _DTYPES.items()}[dtype]

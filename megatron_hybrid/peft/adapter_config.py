"""``adapter_config.json`` as peft 0.21.2 reads it.

Every field of peft's ``LoraConfig`` is in :data:`FIELDS`, with what it does when peft loads a
folder (``PeftModel.from_pretrained``) and what this package does with it: honoured exactly as
peft applies it (the targets, with peft's matching rules; ``use_rslora``; ``lora_dropout`` for
further training), no effect on a loaded adapter (metadata, initialisation settings whose values
the file replaces), or refused by name with the reason (DoRA, aLoRA, biases, saved modules, LoRA
variants, megatron-specific settings, ...). A field peft does not know is refused too, so a
folder never means one thing to peft and another here.

The matching functions are peft's, restated (peft 0.21.2, ``tuners/tuners_utils.py``:
``check_target_module_exists``, ``BaseTuner._inject_parameters``; ``utils/other.py``:
``match_target_against_key``, ``get_pattern_key``): a list of ``target_modules`` matches a module
whose name is an entry or ends with ``.<entry>`` (then ``layers_to_transform`` filters by layer
index), a string is a regular expression the whole name must match; ``exclude_modules`` likewise
(checked first); ``target_parameters`` match parameter names by suffix. This module reads JSON
and matches names only: which names a model has comes from :mod:`megatron_hybrid.peft.load`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.peft.config import LoRAConfigError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FIELDS",
    "AdapterConfig",
    "PeftAdapterError",
    "read_adapter_config",
]

#: File names of a PEFT adapter folder.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: peft's shorthand for "every linear layer but the output layer".
_ALL_LINEAR = "all-linear"


class PeftAdapterError(LoRAConfigError):
    """A PEFT folder that does not fit the model; the message names what and where."""


def _absent(value) -> bool:
    return value in (None, False, [], {}, "")


def _default_only(reason: str) -> Callable[[object], str | None]:
    """A field refused unless it holds its default (None, False, empty)."""
    return lambda value: None if _absent(value) else reason


def _variant(name: str) -> Callable[[object], str | None]:
    return _default_only(
        f"{name} is a LoRA variant that computes something else than W x + scale B A x, which "
        "is what this package's adapters compute"
    )


def _task_type(value) -> str | None:
    if value in (None, "CAUSAL_LM"):
        return None
    return (
        "peft builds a model for another task around the adapter (another head, "
        "PeftModelFor<task>); only causal language models (CAUSAL_LM) are loaded here"
    )


def _bias(value) -> str | None:
    if value in (None, "none"):
        return None
    return (
        "peft then trains and saves the base model's biases with the adapter ('all': every "
        "bias, 'lora_only': those of adapted layers); only LoRA weights are loaded here "
        "(bias must be 'none')"
    )


#: init_lora_weights values peft re-runs at load without touching the base (the file's values
#: then replace what they drew). The others (pissa*, olora, corda, loftq) rewrite the base
#: weight as ``W - scale B0 A0`` while loading, or are LoRA variants (mica).
_HARMLESS_INITS = (True, False, "gaussian", "eva", "orthogonal")


def _init(value) -> str | None:
    if value in _HARMLESS_INITS:
        return None
    return (
        "peft runs this initialisation again while loading the adapter and it changes the base "
        "weights (W - scale * B0 A0 for pissa, olora, corda, loftq) or the layer (mica), so "
        "the folder needs the base it was made against; convert the adapter to a plain one "
        "(peft's save_pretrained(path_initial_model_for_weight_conversion=...)) first"
    )


def _megatron_core(value) -> str | None:
    if value in (None, "megatron.core"):
        return None
    return "a megatron-specific setting of peft's own Megatron integration (megatron_config)"


@dataclass(frozen=True)
class Field:
    """One ``LoraConfig`` field.

    Attributes:
        role: ``"metadata"`` (no effect on the math), ``"honoured"`` (applied as peft applies
            it), ``"initialisation"`` (how peft draws a new adapter: no effect on a loaded one)
            or ``"refused"`` (refused unless at its default).
        check: ``value -> reason`` the value is refused for, or None.
    """

    role: str
    check: Callable[[object], str | None] = lambda value: None


_METADATA = Field("metadata")
_HONOURED = Field("honoured")
_INITIALISATION = Field("initialisation")


def _refused(check: Callable[[object], str | None]) -> Field:
    return Field("refused", check)


#: Every field of peft 0.21.2's ``LoraConfig`` (and ``PeftConfig``) an ``adapter_config.json``
#: can hold. Fields outside this table are refused.
FIELDS: dict[str, Field] = {
    "peft_type": _METADATA,  # checked to be LORA
    "task_type": Field("metadata", _task_type),
    "base_model_name_or_path": _METADATA,
    "revision": _METADATA,
    "inference_mode": _METADATA,
    "auto_mapping": _METADATA,
    "peft_version": _METADATA,
    "r": _HONOURED,
    "lora_alpha": _HONOURED,
    "lora_dropout": _HONOURED,  # training only; peft refuses it with target_parameters
    "use_rslora": _HONOURED,
    "target_modules": _HONOURED,
    "exclude_modules": _HONOURED,
    "layers_to_transform": _HONOURED,
    "layers_pattern": _HONOURED,
    "target_parameters": _HONOURED,
    "rank_pattern": _HONOURED,  # values equal to r only (one rank per adapter here)
    "alpha_pattern": _HONOURED,  # values equal to lora_alpha only
    "fan_in_fan_out": _HONOURED,  # peft resets it to False on torch.nn.Linear
    "init_lora_weights": Field("initialisation", _init),
    "loftq_config": _INITIALISATION,
    "eva_config": _INITIALISATION,
    "corda_config": _INITIALISATION,
    "lora_ga_config": _INITIALISATION,
    "qalora_group_size": _INITIALISATION,  # read only with use_qalora (refused)
    "runtime_config": _METADATA,  # peft does not save it (runtime options)
    "use_dora": _refused(
        _default_only(
            "DoRA rescales every output by a learned magnitude vector (lora_magnitude_vector); "
            "this package's adapters compute plain LoRA"
        )
    ),
    "lora_bias": _refused(_default_only("a bias on lora_B adds a term plain LoRA does not have")),
    "bias": _refused(_bias),
    "modules_to_save": _refused(
        _default_only(
            "peft replaces these modules by full trained copies stored in the folder; only "
            "LoRA adapters are loaded here"
        )
    ),
    "layer_replication": _refused(
        _default_only("peft repeats layers of the base (another depth) before adapting them")
    ),
    "trainable_token_indices": _refused(
        _default_only("peft trains the listed embedding rows (stored in the folder) as well")
    ),
    "alora_invocation_tokens": _refused(
        _default_only(
            "Activated LoRA applies the adapter only from the invocation tokens on; these "
            "adapters apply to every token, so the log-probs would differ"
        )
    ),
    "use_qalora": _refused(
        _default_only("QA-LoRA pools the adapter's input in groups (GPTQ models)")
    ),
    "velora_config": _refused(_variant("VeLoRA")),
    "monteclora_config": _refused(_variant("MonteCLoRA")),
    "use_bdlora": _refused(_variant("BD-LoRA (block-diagonal A or B)")),
    "arrow_config": _refused(_variant("Arrow (adapter routing)")),
    "kasa_config": _refused(_variant("KaSA")),
    "megatron_config": _refused(
        _default_only(
            "a megatron-specific setting of peft's own Megatron integration; this package's "
            "adapters are its own (load the folder without it)"
        )
    ),
    "megatron_core": _refused(_megatron_core),
    "ensure_weight_tying": _refused(
        _default_only(
            "peft ties adapters of tied embedding and output layers, which are not adapted here"
        )
    ),
}


def _names(path: Path, field: str, value, *, regex: bool) -> frozenset[str] | str | None:
    """A ``target_modules``-like value: None, a regular expression or a set of names."""
    if value is None:
        return None
    if isinstance(value, str):
        if not regex:
            raise PeftAdapterError(f"{path}: {field} must be a list of names, got {value!r}")
        try:
            re.compile(value)
        except re.error as error:
            raise PeftAdapterError(
                f"{path}: {field} {value!r} is not a regular expression ({error})"
            ) from None
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PeftAdapterError(f"{path}: {field} must be a list of names, got {value!r}")
    return frozenset(value)


def _number(path: Path, field: str, value, *, low: float, high: float | None = None) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (high is not None and value >= high):
        span = f">= {low}" if high is None else f"in [{low}, {high})"
        raise PeftAdapterError(f"{path}: {field}={value!r} must be a number {span}")
    return float(value)


@dataclass(frozen=True)
class AdapterConfig:
    """A checked ``adapter_config.json``.

    Attributes:
        path: the file.
        rank, alpha, dropout, use_rslora: ``r``, ``lora_alpha``, ``lora_dropout``,
            ``use_rslora``.
        target_modules: a set of names (suffix matches), a regular expression, or None.
        exclude_modules: likewise.
        layers_to_transform: layer indices (an int or a tuple), or None.
        layers_pattern: names of the layer lists (``layers``) or None.
        target_parameters: parameter names (suffix matches).
        rank_pattern, alpha_pattern: peft's per-module rank and alpha (pattern -> value).
        fan_in_fan_out: as written (peft resets it to False on ``torch.nn.Linear``).
    """

    path: Path
    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: frozenset[str] | str | None
    exclude_modules: frozenset[str] | str | None
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    target_parameters: tuple[str, ...]
    rank_pattern: dict
    alpha_pattern: dict
    fan_in_fan_out: bool

    # --- peft's matching, restated -----------------------------------------------------------

    def excluded(self, key: str) -> bool:
        """Whether ``exclude_modules`` excludes module ``key``."""
        exclude = self.exclude_modules
        if not exclude:
            return False
        if isinstance(exclude, str):
            return re.fullmatch(exclude, key) is not None
        return key in exclude or any(key.endswith(f".{e}") for e in exclude)

    def _layer_index(self, key: str) -> int | None:
        patterns = self.layers_pattern
        match = None
        if not patterns:
            # The first numbered segment (the layer), not an expert index after it.
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for pattern in patterns:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        return None if match is None else int(match.group("idx"))

    def targets_module(self, key: str) -> bool:
        """Whether peft puts an adapter on module ``key`` (``check_target_module_exists``,
        exclusions included)."""
        if self.excluded(key):
            return False
        targets = self.target_modules
        if targets is None:
            return False
        if isinstance(targets, str):
            return re.fullmatch(targets, key) is not None
        if key in targets:  # a full name: layers_to_transform does not apply (as in peft)
            return True
        if not any(key.endswith(f".{t}") for t in targets):
            return False
        layers = self.layers_to_transform
        if layers is None or layers == ():
            return True
        index = self._layer_index(key)
        if index is None:
            return False
        return index == layers if isinstance(layers, int) else index in layers

    def targets_parameter(self, key: str) -> bool:
        """Whether peft wraps parameter ``key`` (``_inject_parameters``: suffix matches)."""
        return any(key == t or key.endswith(f".{t}") for t in self.target_parameters)

    def _pattern_value(self, patterns: dict, key: str, default):
        for pattern in patterns:  # get_pattern_key: the first pattern that ends the name
            if re.match(rf"(.*\.)?({pattern})$", key):
                return patterns[pattern]
        return default

    def rank_of(self, key: str) -> int:
        """The rank peft gives module or parameter ``key`` (``rank_pattern``)."""
        return self._pattern_value(self.rank_pattern, key, self.rank)

    def alpha_of(self, key: str) -> float:
        """The alpha peft gives module or parameter ``key`` (``alpha_pattern``)."""
        return self._pattern_value(self.alpha_pattern, key, self.alpha)

    def resolve_regex(self, names: Iterable[str]) -> frozenset[str]:
        """Leaf names of ``names`` that a string ``target_modules`` matches: what peft 0.21
        turns a regular expression into for models whose MoE layout changed in transformers 5
        (``utils/transformers_weight_conversion.py``: ``_resolve_string_target_modules``)."""
        return frozenset(n.rsplit(".", 1)[-1] for n in names if self.targets_module(n))


def _read_json(path: Path) -> dict:
    """The JSON object of ``path``; every failure names the file (and the line)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise PeftAdapterError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise PeftAdapterError(
            f"{path} line {line} is not UTF-8 text (byte {error.start}): not an adapter config"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PeftAdapterError(
            f"{path} line {error.lineno} column {error.colno} is not valid JSON: {error.msg}"
        ) from None
    if not isinstance(data, dict):
        raise PeftAdapterError(
            f"{path} holds a JSON {type(data).__name__}, not the object of LoraConfig fields "
            "peft writes"
        )
    return data


def _check_fields(path: Path, data: dict) -> None:
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise PeftAdapterError(
            f"{path}: unknown field(s) {unknown}: peft 0.21.2's LoraConfig has no such field, so "
            "what the adapter computes with them is unknown (written by another tool or a "
            "newer peft?)"
        )
    if data.get("peft_type") != "LORA":
        raise PeftAdapterError(f"{path}: peft_type {data.get('peft_type')!r}, expected 'LORA'")
    for name, value in data.items():
        reason = FIELDS[name].check(value)
        if reason:
            raise PeftAdapterError(f"{path}: {name}={value!r} is not supported: {reason}")


def _patterns(path: Path, field: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in value.items()
    ):
        raise PeftAdapterError(f"{path}: {field} must map names to numbers, got {value!r}")
    return dict(value)


def read_adapter_config(folder) -> AdapterConfig:
    """Read and check a folder's ``adapter_config.json`` (see :data:`FIELDS`).

    Raises:
        PeftAdapterError: the file cannot be read or parsed, a field is unknown or refused, a
            value is malformed, or peft itself would refuse the combination (the message names
            the file and the field).
    """
    path = Path(folder) / ADAPTER_CONFIG
    data = _read_json(path)
    _check_fields(path, data)
    rank = data.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise PeftAdapterError(f"{path}: r={rank!r} is not a rank (an int >= 1)")
    alpha = _number(path, "lora_alpha", data.get("lora_alpha", 8), low=0)
    if alpha == 0:
        raise PeftAdapterError(f"{path}: lora_alpha=0 makes the adapter a no-op")
    dropout = _number(path, "lora_dropout", data.get("lora_dropout") or 0.0, low=0, high=1)
    targets = data.get("target_modules")
    if isinstance(targets, str) and targets.lower() == _ALL_LINEAR:
        raise PeftAdapterError(
            f"{path}: target_modules {targets!r} is resolved by peft from the transformers "
            "model's module classes (every torch.nn.Linear but the output layer, shared-expert "
            "gates included); save the adapter with peft, which writes the names, or list them"
        )
    parameters = data.get("target_parameters") or []
    if isinstance(parameters, str) or not (
        isinstance(parameters, list) and all(isinstance(p, str) for p in parameters)
    ):
        # peft: "`target_parameters` must be a list of strings or None."
        raise PeftAdapterError(f"{path}: target_parameters must be a list of names, got "
                               f"{parameters!r}")  # fmt: skip
    if targets is None and not parameters:
        raise PeftAdapterError(
            f"{path}: no target_modules and no target_parameters: peft would pick targets by "
            "model type; name the adapted modules"
        )
    layers = data.get("layers_to_transform")
    pattern = data.get("layers_pattern")
    # peft's own LoraConfig.__post_init__ refuses these combinations.
    if isinstance(targets, str) and layers is not None:
        raise PeftAdapterError(
            f"{path}: layers_to_transform cannot be used when target_modules is a str (peft "
            "refuses it)"
        )
    if isinstance(targets, str) and pattern is not None:
        raise PeftAdapterError(
            f"{path}: layers_pattern cannot be used when target_modules is a str (peft refuses "
            "it)"
        )
    if pattern and layers is None:
        raise PeftAdapterError(
            f"{path}: layers_pattern needs layers_to_transform (peft refuses it alone)"
        )
    if layers is not None and not (
        (isinstance(layers, int) and not isinstance(layers, bool))
        or (isinstance(layers, list) and all(isinstance(i, int) for i in layers))
    ):
        raise PeftAdapterError(f"{path}: layers_to_transform must be an int or a list of ints, "
                               f"got {layers!r}")  # fmt: skip
    if pattern is not None and not (
        isinstance(pattern, str)
        or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))
    ):
        raise PeftAdapterError(f"{path}: layers_pattern must be a name or a list of names, got "
                               f"{pattern!r}")  # fmt: skip
    if data.get("init_lora_weights") == "orthogonal" and rank % 2:
        raise PeftAdapterError(
            f"{path}: init_lora_weights='orthogonal' needs an even r, got {rank} (peft refuses "
            "it while loading)"
        )
    for name in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(data.get(name, False), bool):
            raise PeftAdapterError(f"{path}: {name} must be true or false, got {data[name]!r}")
    return AdapterConfig(
        path=path,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        use_rslora=data.get("use_rslora", False),
        target_modules=_names(path, "target_modules", targets, regex=True),
        exclude_modules=_names(path, "exclude_modules", data.get("exclude_modules"), regex=True),
        layers_to_transform=tuple(layers) if isinstance(layers, list) else layers,
        layers_pattern=(pattern,) if isinstance(pattern, str) else tuple(pattern or ()) or None,
        target_parameters=tuple(parameters),
        rank_pattern=_patterns(path, "rank_pattern", data.get("rank_pattern")),
        alpha_pattern=_patterns(path, "alpha_pattern", data.get("alpha_pattern")),
        fan_in_fan_out=data.get("fan_in_fan_out", False),
    )

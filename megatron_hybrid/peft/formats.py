"""The PEFT folder layouts of an adapter: tensor names, routed experts, ``adapter_config.json``.

Two formats (names are transformers' in-memory module names after ``base_model.model.``):

* ``"peft"``: what ``peft>=0.19`` writes and ``PeftModel.from_pretrained`` loads on the
  transformers model. Linears get module LoRA (``<module>.lora_A.weight [r, in]``,
  ``lora_B.weight [out, r]``). Routed experts are transformers' 3-D parameters, adapted
  through ``target_parameters``: PEFT nests one ``ParamWrapper`` per adapted parameter in
  registration order, so the last one (``down_proj``) is ``experts.lora_*`` and the one before
  (``gate_up_proj``, Nemotron-H ``up_proj``) ``experts.base_layer.lora_*``; ``lora_A`` is
  ``[E*r, in]`` with expert-major rows (``e*r + k``) and ``lora_B`` ``[out, r*E]`` with
  rank-major columns (``k*E + e``), ``delta_e = scale * B_e A_e`` in the parameter's
  ``[out, in]`` orientation (peft 0.21.2 ``tuners/lora/layer.py``: ``ParamWrapper``).
* ``"per_expert"``: the same, with routed experts as per-expert 2-D modules
  (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, ``A`` copied to gate and up) for
  engines and model classes that read those names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["FORMATS", "PEFT_PREFIX", "PeftFamily", "peft_family"]

#: The two folder formats.
FORMATS = ("peft", "per_expert")

#: Prefix of every tensor name in a PEFT adapter file (``PeftModel.base_model.model``).
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class PeftFamily:
    """What PEFT does differently per Hugging Face family.

    Attributes:
        modules_as_parameters: Megatron targets whose pieces must be named as 2-D
            ``target_parameters`` (``gate_proj.weight``): peft 0.21's transformers-v5 weight
            conversion sends ``gate_proj``/``up_proj``/``down_proj`` in ``target_modules`` of
            ``qwen2_moe``-pattern models (Qwen3-Next, DeepSeek-V3 reuse it) to the routed
            experts, and the dense and shared MLPs then get no adapter, silently
            (``utils/transformers_weight_conversion.py``: ``_MOE_TARGET_MODULE_MAPPING``).
        refused: ``(layer symbol, Megatron target) -> reason`` for adapters PEFT cannot hold.
        moved_targets: ``target_modules`` names peft 0.21 moves to the routed experts'
            parameters (old name -> the parameter it becomes) when it loads an adapter of this
            family (its transformers-v4-to-v5 conversion, ``_MOE_TARGET_MODULE_MAPPING``: a
            regular expression is first turned into the leaf names it matches), so they no
            longer adapt the modules they name.
        incompatible_leaves: module names peft refuses as LoRA targets for this family
            (``_check_lora_target_modules_mamba``), with the reason.
    """

    modules_as_parameters: frozenset[str] = frozenset()
    refused: dict = field(default_factory=dict)
    moved_targets: dict = field(default_factory=dict)
    incompatible_leaves: dict = field(default_factory=dict)


_MLP = frozenset({"linear_fc1", "linear_fc2"})
#: peft 0.21's ``qwen2_moe`` conversion pattern (Qwen3-Next and DeepSeek-V3 reuse it).
_QWEN2_MOE_MOVED = {
    "gate": "gate.weight",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
_MAMBA_OUT_PROJ = (
    "peft 0.21 refuses LoRA on Mamba's out_proj for nemotron_h "
    "(tuners/tuners_utils.py: _check_lora_target_modules_mamba), so no PEFT folder "
    "can hold it; export the merged weights instead (iter_hf_weights(model, "
    "merge_lora=True), save_hf_checkpoint(..., merge_lora=True), convert --to-hf "
    "OUT --merge-lora), or train without it (LoRAConfig(exclude=['out_proj']))"
)
_FAMILIES = {
    "qwen3_next": PeftFamily(modules_as_parameters=_MLP, moved_targets=_QWEN2_MOE_MOVED),
    "deepseek_v3": PeftFamily(modules_as_parameters=_MLP, moved_targets=_QWEN2_MOE_MOVED),
    "nemotron_h": PeftFamily(
        refused={("M", "out_proj"): _MAMBA_OUT_PROJ},
        incompatible_leaves={
            "out_proj": _MAMBA_OUT_PROJ,
            "conv1d": "peft 0.21 refuses LoRA on Mamba's conv1d for nemotron_h "
            "(tuners/tuners_utils.py: _check_lora_target_modules_mamba)",
        },
    ),
}


def peft_family(name: str) -> PeftFamily:
    """The :class:`PeftFamily` of a Hugging Face family (the default for most)."""
    return _FAMILIES.get(name, PeftFamily())


#: A decoder layer's prefix in an in-memory name (``model.layers.3.``).
_LAYER = re.compile(r"^(?:.*\.)?layers\.\d+\.")


def layer_relative(name: str) -> str:
    """``model.layers.3.mlp.experts.gate_up_proj`` -> ``mlp.experts.gate_up_proj``."""
    return _LAYER.sub("", name, count=1)


def leaf(name: str) -> str:
    """The last component of a module name."""
    return name.rsplit(".", 1)[-1]


def experts_names(module: str, params: list[str], which: str) -> tuple[str, str]:
    """PEFT's ``(lora_A, lora_B)`` names of parameter ``which`` of an experts module whose
    adapted parameters are ``params`` in registration order (the last is outermost)."""
    depth = len(params) - 1 - params.index(which)
    inner = "base_layer." * depth
    return (
        f"{PEFT_PREFIX}{module}.{inner}lora_A.weight",
        f"{PEFT_PREFIX}{module}.{inner}lora_B.weight",
    )


def module_names(module: str) -> tuple[str, str]:
    """``(lora_A, lora_B)`` names of module LoRA on ``module``."""
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def pack_experts(a: list, b: list):
    """PEFT's ``ParamWrapper`` tensors from per-expert ``A_e [r, in]`` and ``B_e [out, r]``:
    ``A [E*r, in]`` (expert-major rows), ``B [out, r*E]`` (rank-major columns)."""
    import torch

    stacked = torch.stack(b)  # [E, out, r]
    experts, out, rank = stacked.shape
    return torch.cat(a), stacked.permute(1, 2, 0).reshape(out, rank * experts)


def unpack_experts(a, b, experts: int, rank: int):
    """Per-expert ``(A_e, B_e)`` lists from PEFT's ``ParamWrapper`` tensors (the inverse of
    :func:`pack_experts`; shapes checked by the caller)."""
    out = b.shape[0]
    per_expert_b = b.reshape(out, rank, experts)
    return (
        [a[e * rank : (e + 1) * rank] for e in range(experts)],
        [per_expert_b[:, :, e] for e in range(experts)],
    )


def config_targets(active: list[tuple[str, str]], instances: dict[str, set[str]]) -> list[str]:
    """Target names for ``adapter_config.json``: a group's key when every instance of it in the
    base model is adapted (``q_proj`` for every attention layer), else the full names adapted.

    Args:
        active: ``(group, name)`` of every adapted module or parameter.
        instances: group -> every name of the base model in that group.
    """
    groups: dict[str, set[str]] = {}
    for group, name in active:
        groups.setdefault(group, set()).add(name)
    out: set[str] = set()
    for group, names in groups.items():
        out |= {group} if names == instances.get(group, set()) else names
    return sorted(out)

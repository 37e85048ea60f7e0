"""A model's adapter pieces by their PEFT names, from the conversion plan.

Every name comes from the plan (:mod:`megatron_hybrid.hf.plan`) and the family record: a
module piece is a Hugging Face tensor the plan links to a linear's checkpoint key (its rows
are where the plan puts them), routed experts are the plan's :class:`FusedExperts`. Module
names are transformers' in-memory ones (``Family.module_name``), which PEFT files use.
"""

from __future__ import annotations

from megatron_hybrid.hf.config import family_named
from megatron_hybrid.hf.plan import FusedExperts, Plan
from megatron_hybrid.peft.config import MEGATRON_TARGETS, LoRAConfigError
from megatron_hybrid.peft.formats import (
    FORMATS,
    experts_names,
    layer_relative,
    leaf,
    module_names,
    peft_family,
)

__all__ = ["Naming", "target_of_key"]


def target_of_key(key: str) -> str:
    """``decoder.layers.0.self_attention.in_proj.weight.query`` -> ``in_proj``."""
    return key.rpartition(".weight")[0].rsplit(".", 1)[-1]


def _is_mtp(key: str) -> bool:
    return key.startswith("mtp.")


class Naming:
    """PEFT names of one converted model.

    Args:
        conversion: the model's Hugging Face conversion.
        plan: its plan over the whole model.
        format: ``"peft"`` or ``"per_expert"``.
    """

    def __init__(self, conversion, plan: Plan, format: str = "peft") -> None:
        if format not in FORMATS:
            raise LoRAConfigError(f"unknown adapter format {format!r}; choose one of {FORMATS}")
        self.conversion, self.plan, self.format = conversion, plan, format
        self.family = family_named(conversion.family)
        self.peft = peft_family(conversion.family)
        self.position = {name: i for i, name in enumerate(plan.hf_shapes)}

    def memory(self, name: str) -> str:
        """transformers' in-memory name of on-disk ``name``."""
        return self.family.module_name(name, self.conversion.hf_prefix)

    def module(self, piece: str) -> tuple[str, str]:
        """``(lora_A, lora_B)`` names of a module piece (on-disk module name)."""
        return module_names(self.memory(piece))

    def fused_modules(self) -> dict[str, list[FusedExperts]]:
        """On-disk experts module -> its 3-D parameters in registration order (MTP left out:
        transformers has no MTP modules)."""
        out: dict[str, list[FusedExperts]] = {}
        for fused in self.plan.fused_experts.values():
            if not _is_mtp(fused.key):
                out.setdefault(fused.module, []).append(fused)
        return {k: sorted(v, key=lambda f: f.order) for k, v in out.items()}

    def experts(self, fused: FusedExperts, adapted: list[str]) -> tuple[str, str]:
        """``(lora_A, lora_B)`` of ``fused`` when the module's adapted parameters are
        ``adapted`` (registration order)."""
        return experts_names(self.memory(fused.module), adapted, fused.param)

    def expert_links(self, fused: FusedExperts, expert: int) -> list:
        """The plan's links of one expert of ``fused`` (its per-expert on-disk tensors)."""
        return list(self.plan.by_key.get((fused.key, expert), ()))

    def as_parameter(self, target: str) -> bool:
        """Whether pieces of Megatron target ``target`` go into ``target_parameters``."""
        return target in self.peft.modules_as_parameters

    def instances(self) -> dict[str, set[str]]:
        """Config group -> every in-memory name of the base model in it (see
        :meth:`piece_entry`, :meth:`fused_entry`)."""
        out: dict[str, set[str]] = {}
        for link in self.plan.links:
            if _is_mtp(link.key) or target_of_key(link.key) not in MEGATRON_TARGETS:
                continue
            if link.key in self.plan.fused_experts and self.format == "peft":
                continue
            group, name = self.piece_entry(link.hf_name.removesuffix(".weight"), link.key)
            out.setdefault(group, set()).add(name)
        if self.format == "peft":
            for fused in self.plan.fused_experts.values():
                if not _is_mtp(fused.key):
                    group, name = self.fused_entry(fused)
                    out.setdefault(group, set()).add(name)
        return out

    def model_names(self) -> tuple[dict[str, str | None], dict[str, object]]:
        """The module and parameter names of the transformers model, as peft matches them.

        Derived from the plan's tensors (MTP layers and stored copies left out: transformers
        has no modules for them); a routed expert is transformers' 3-D parameter, not the
        per-expert tensors on disk.

        Returns:
            ``(modules, parameters)``: in-memory module name -> the module piece LoRA adapts
            there (its on-disk name), or None for any other module (containers, norms,
            embeddings, routers, the output layer); in-memory parameter name -> the
            :class:`FusedExperts` or module piece it belongs to, or None.
        """
        modules: dict[str, str | None] = {}
        parameters: dict[str, object] = {}
        pieces = {}
        for link in self.plan.links:
            if _is_mtp(link.key) or link.key in self.plan.fused_experts:
                continue
            if target_of_key(link.key) in MEGATRON_TARGETS:
                pieces[link.hf_name] = link.hf_name.removesuffix(".weight")
        for name in self.plan.hf_shapes:
            links = self.plan.by_hf.get(name, ())
            if name in self.plan.shared_copies or (links and all(_is_mtp(x.key) for x in links)):
                continue
            if any(x.key in self.plan.fused_experts for x in links):
                continue  # a per-expert tensor on disk: the fused parameter stands for it
            memory = self.memory(name)
            parameters[memory] = pieces.get(name)
            parts = memory.split(".")[:-1]
            for i in range(1, len(parts) + 1):
                modules.setdefault(".".join(parts[:i]), None)
        for fused in self.plan.fused_experts.values():
            if _is_mtp(fused.key):
                continue
            module = self.memory(fused.module)
            parameters[f"{module}.{fused.param}"] = fused
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                modules.setdefault(".".join(parts[:i]), None)
        for piece in pieces.values():
            modules[self.memory(piece)] = piece
        return modules, parameters

    def piece_entry(self, piece: str, key: str) -> tuple[str, str]:
        """``(group, name)`` of a module piece in ``adapter_config.json``: ``target_modules``
        hold module names grouped by leaf (``q_proj``); 2-D ``target_parameters`` hold
        ``<module>.weight`` grouped as ``gate_proj.weight``."""
        name = self.memory(piece)
        if self.as_parameter(target_of_key(key)):
            return f"{leaf(name)}.weight", f"{name}.weight"
        return leaf(name), name

    def fused_entry(self, fused: FusedExperts) -> tuple[str, str]:
        """``(group, name)`` of a routed-expert parameter in ``target_parameters``
        (``mlp.experts.gate_up_proj``)."""
        name = f"{self.memory(fused.module)}.{fused.param}"
        return layer_relative(name), name

"""PEFT as the oracle for LoRA: adapters made by ``peft`` on the transformers model.

:func:`make_adapter` wraps the transformers model of a tiny Hugging Face checkpoint (from
``hf_oracle``) with ``peft.get_peft_model`` under the documented config of each family (module
LoRA on every linear; routed experts, and for Qwen3-Next / DeepSeek-V3 the dense and shared
MLPs, as ``target_parameters``), gives EVERY LoRA tensor a random value (PEFT's B = 0 would hide
any mistake), saves it with ``save_pretrained`` and returns PEFT's logits and merged weights.
The tiny configs have ``2 * moe_intermediate_size != hidden_size`` so that a transposed or
mis-packed expert layout fails on shape as well as on logits.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import hf_oracle
import torch
from rounding import float32_bounds, max_abs

#: Max abs logit difference allowed against PEFT where the model is well conditioned (the
#: Hugging Face oracle's tolerance; see hf_oracle.TOLERANCE).
TOLERANCE = hf_oracle.TOLERANCE

#: Overrides of the hf_oracle configs of the MoE families: 2 * 24 != 64 (hidden), so
#: gate_up_proj is not square.
OVERRIDES = {"moe_intermediate_size": 24}
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "nemotron_h")


def overrides(family: str) -> dict:
    """Config overrides of ``family`` (none for the dense Qwen3.5)."""
    return {} if family == "qwen3_5" else dict(OVERRIDES)


RANK, ALPHA = 4, 8

_MODULES = {
    "qwen3_5": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_5_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                    "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba",
                   "out_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    # Mamba's out_proj: refused by peft for nemotron_h.
    "nemotron_h": ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
}  # fmt: skip
_DENSE_AS_PARAMETERS = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
_PARAMETERS = {
    "qwen3_5": [],
    "qwen3_5_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "qwen3_next": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *_DENSE_AS_PARAMETERS],
    "deepseek_v3": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *_DENSE_AS_PARAMETERS],
    "nemotron_h": ["mixer.experts.up_proj", "mixer.experts.down_proj"],
}


def lora_config(family: str, **overrides):
    """PEFT's ``LoraConfig`` for ``family`` as docs/lora.md documents it."""
    from peft import LoraConfig

    kwargs = dict(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=_MODULES[family],
        target_parameters=_PARAMETERS[family] or None,
        task_type="CAUSAL_LM",
    )
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def load_base(folder: str | Path):
    """transformers' float32 model of a checkpoint folder (torch kernels bound)."""
    from transformers import AutoModelForCausalLM

    hf_oracle.modeling_module(hf_oracle._family_of(Path(folder)))
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def randomise_lora(model, seed: int = 0, std: float = 0.05) -> int:
    """Give every LoRA tensor of a PEFT model a random value; return how many there are."""
    generator = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=generator))
                count += 1
    return count


def logits(model, input_ids: torch.Tensor, rounding=None) -> torch.Tensor:
    with torch.no_grad(), rounding or contextlib.nullcontext():
        return model(input_ids=input_ids, use_cache=False).logits.float()


def logits_bound(model, input_ids: torch.Tensor) -> float:
    """How far correct float32 logits of a PEFT ``model`` may lie from PEFT's on any machine:
    :data:`TOLERANCE`, or the margin times their rounding scale where larger (as
    ``hf_oracle.logits_bound``; GatedDeltaNet's recurrence amplifies rounding)."""
    bounds = float32_bounds(
        lambda rounding: {"logits": logits(model, input_ids, rounding)},
        measure=max_abs,
        floor=TOLERANCE,
    )
    return bounds["logits"]


def make_adapter(family: str, hf_folder, out, input_ids, *, seed: int = 0, **config):
    """A random PEFT adapter of ``family`` saved under ``out``.

    Returns:
        ``(folder, peft logits, their bound (:func:`logits_bound`), tensor count, merged on-disk
        tensors)``.
    """
    from peft import get_peft_model

    model = get_peft_model(load_base(hf_folder), lora_config(family, **config))
    count = randomise_lora(model, seed)
    model.save_pretrained(out)
    reference = logits(model, input_ids)
    bound = logits_bound(model, input_ids)
    merged_dir = Path(out).with_name(Path(out).name + "_merged")
    model.merge_and_unload().save_pretrained(merged_dir)
    return Path(out), reference, bound, count, hf_oracle.read_tensors(merged_dir)


def peft_model(hf_folder, adapter_folder):
    """PEFT's model of ``hf_folder`` with ``adapter_folder`` loaded (float32, eval mode)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(hf_folder), adapter_folder).eval()


def peft_logits(hf_folder, adapter_folder, input_ids) -> tuple[torch.Tensor, int]:
    """PEFT's logits with ``adapter_folder`` loaded, and how many LoRA tensors it made live."""
    model = peft_model(hf_folder, adapter_folder)
    live = sum(1 for name, _ in model.named_parameters() if "lora_" in name)
    return logits(model, input_ids), live


def peft_bound(hf_folder, adapter_folder, input_ids) -> float:
    """:func:`logits_bound` of PEFT's model with ``adapter_folder`` loaded."""
    return logits_bound(peft_model(hf_folder, adapter_folder), input_ids)

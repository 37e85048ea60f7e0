"""LoRA for hybrid stacks, routed experts included; PEFT folders in and out.

See ``docs/lora.md``.
"""

from megatron_hybrid.peft.apply import apply_lora, disable_lora, lora_parameters
from megatron_hybrid.peft.config import LoRAConfig, LoRAConfigError
from megatron_hybrid.peft.export import iter_lora_weights, lora_config_dict, save_peft_adapter
from megatron_hybrid.peft.load import PeftAdapterError, load_peft_adapter

__all__ = [
    "LoRAConfig",
    "LoRAConfigError",
    "PeftAdapterError",
    "apply_lora",
    "disable_lora",
    "iter_lora_weights",
    "load_peft_adapter",
    "lora_config_dict",
    "lora_parameters",
    "save_peft_adapter",
]

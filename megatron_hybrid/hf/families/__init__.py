"""Hugging Face families; importing this package registers them."""

from megatron_hybrid.hf.families import deepseek, nemotron, qwen  # noqa: F401

__all__: list[str] = []

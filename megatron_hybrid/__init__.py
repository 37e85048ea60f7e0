"""megatron_hybrid: hybrid layer stacks for Megatron-Core."""

from megatron_hybrid.package_info import __version__

__all__ = ["__version__"]

"""Version of megatron_hybrid; the single source that setup.py reads."""

__version__ = "0.1.0"

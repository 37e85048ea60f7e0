"""Command-line tools behind ``python -m megatron_hybrid`` (see ``cli.main``).

Command modules import neither torch nor megatron at import time, so ``--help`` stays fast.
"""

from megatron_hybrid.cli.main import Command, CommandError, main

__all__ = ["Command", "CommandError", "main"]

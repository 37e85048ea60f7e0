"""Entry point and command registry of ``python -m megatron_hybrid``.

Each command is a module that defines ``COMMAND = Command(name, help, configure, run)``:
``configure(parser)`` adds its arguments, ``run(args)`` returns the exit code. Registering a
command is one line in :data:`COMMAND_MODULES`. Command modules must not import torch (or
megatron) at import time: every module is imported to build ``--help``.

Bad input exits with code 2 and one message on stderr, never a traceback: argparse does so for
bad flags, and :func:`main` does so for :class:`CommandError`, ``ImportError`` (a backend the
flags ask for is missing) and ``ValueError`` (which includes
``HybridPatternError``) raised by a command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.package_info import __version__

__all__ = ["COMMAND_MODULES", "Command", "CommandError", "build_parser", "main"]

#: Modules that define a ``COMMAND``, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "megatron_hybrid.cli.describe",
    "megatron_hybrid.cli.train",
    "megatron_hybrid.cli.check_checkpoint",
    "megatron_hybrid.cli.convert",
)

#: Exit code for bad input, as argparse uses.
USAGE_ERROR = 2

# Characters of patterns (and repetition counts); no option name is made of these alone.
_PATTERN_CHARS = frozenset("MG*D+-E[](){}|/0123456789")


class CommandError(Exception):
    """Bad input or a missing optional dependency: printed as one message, exit code 2."""


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand.

    Attributes:
        name: Subcommand name (``describe``).
        help: One line for the command list of ``--help``.
        configure: Adds the command's arguments to its parser.
        run: Runs the command on the parsed arguments and returns the exit code.
        description: Longer text for the command's own ``--help`` (defaults to ``help``).
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


def load_commands(modules: Sequence[str] = COMMAND_MODULES) -> tuple[Command, ...]:
    """Import the command modules and return their ``COMMAND`` objects."""
    return tuple(importlib.import_module(module).COMMAND for module in modules)


def _prog() -> str:
    # The console script is called by its own name; `python -m` would otherwise show __main__.py.
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name == "megatron-hybrid" else "python -m megatron_hybrid"


def build_parser(commands: Sequence[Command], prog: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog=prog or _prog(),
        description="Hybrid (Mamba / GatedDeltaNet / attention / MoE) layer stacks for "
        "Megatron-Core.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        sub = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.description or command.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (2 for bad input).

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.
    """
    parser = build_parser(load_commands())
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help/--version (0) or bad flags (2, message printed)
        code = exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
        dashed = [a for a in argv if a != "--" and a.startswith("-") and set(a) <= _PATTERN_CHARS]
        if code == USAGE_ERROR and dashed and "--" not in argv:
            print(
                f"hint: argparse reads {dashed[0]!r} as an option; put a pattern that starts "
                f"with '-' after '--', e.g. describe -- {dashed[0]!r}",
                file=sys.stderr,
            )
        return code
    try:
        return args._run(args)
    except (CommandError, ValueError, ImportError) as error:
        # ImportError: a backend the flags ask for is not installed (e.g. TransformerEngine).
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error. Point stdout at devnull so the
        # interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

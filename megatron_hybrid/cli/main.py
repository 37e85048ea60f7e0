"""Entry point and command registry of ``python -m megatron_hybrid``.

Each command is a module that defines ``COMMAND = Command(name, help, configure, run)``:
``configure(parser)`` adds its arguments, ``run(args)`` returns the exit code. Registering a
command is one line in :data:`COMMAND_MODULES`. Command modules must not import torch (or
megatron) at import time: every module is imported to build ``--help``.

Bad input exits with code 2 and one message on stderr, never a traceback: argparse does so for
bad flags, and :func:`main` does so for :class:`CommandError`, ``ImportError`` (a backend the
flags ask for is missing), ``ValueError`` (which includes ``HybridPatternError``) and
``OSError`` (a file-system failure: a full disk, a folder that cannot be written) raised by a
command. Ctrl-C exits with code 130 (128 + SIGINT, as shells report it) and one line; the
writers leave their outputs as they were (``checkpointing/outputs.py``).

Every command that writes takes ``--overwrite`` (:func:`add_overwrite_flag`), with one meaning:
an output that is not empty is replaced whole once the new one is complete, never mixed with it.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.package_info import __version__
from megatron_hybrid.pattern import HybridPatternError, layer_symbols
from megatron_hybrid.training.settings import SettingsError

__all__ = [
    "COMMAND_MODULES",
    "Command",
    "CommandError",
    "add_overwrite_flag",
    "build_parser",
    "main",
]

#: Modules that define a ``COMMAND``, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "megatron_hybrid.cli.describe",
    "megatron_hybrid.cli.prepare_data",
    "megatron_hybrid.cli.train",
    "megatron_hybrid.cli.check_checkpoint",
    "megatron_hybrid.cli.convert",
    "megatron_hybrid.cli.logprobs",
)

#: Exit code for bad input, as argparse uses.
USAGE_ERROR = 2
#: Exit code after Ctrl-C (128 + SIGINT).
INTERRUPTED = 130


def _pattern_chars() -> frozenset[str]:
    """Characters of patterns (and repetition counts); no option name is made of these alone."""
    return frozenset("".join(layer_symbols()) + "[](){}|/0123456789")


class CommandError(Exception):
    """Bad input or a missing optional dependency: printed as one message, exit code 2."""


def add_overwrite_flag(parser, target: str, detail: str | None = None) -> None:
    """Add ``--overwrite`` (the one definition every writing command uses).

    Args:
        parser: the command's parser or argument group.
        target: the output it applies to, as the user writes it (``--to-hf/--to-peft OUT_DIR``).
        detail: what that means for this command, where it says more.
    """
    more = f" ({detail})" if detail else ""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace what {target} holds instead of refusing an output that is not empty"
        f"{more}: the old contents are removed once the new output is complete, never mixed "
        "with it; a source of the command is never replaced",
    )


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


def _plain(text: str) -> str:
    """Docstring text for a terminal: reST roles and literals become plain quoted text."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"'\1'", text)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and shows each option's default (when it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


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
            description=_plain(command.description or command.help),
            formatter_class=_HelpFormatter,
        )
        command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _reject_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit 2 with the subcommand's usage and the closest flag to the first unknown one."""
    sub = _subparser(parser, command)
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flag = next((a.split("=", 1)[0] for a in unknown if a.startswith("--")), None)
    if flag:
        options = [o for o in sub._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]}?)"
    sub.error(message)


def _pattern_hint(argv: list[str]) -> None:
    """After a usage error: a pattern starting with '-' that argparse read as an option."""
    if "--" in argv:
        return
    dashed = [
        a
        for a in argv
        if a.startswith("-") and set(a) <= _pattern_chars() and not re.fullmatch(r"-\d+", a)
    ]
    if not dashed:
        return
    if "train" in argv or "check-checkpoint" in argv or "logprobs" in argv:
        fix = f"attach it with '=': --hybrid-layer-pattern={dashed[0]!r}"
    else:
        fix = f"put it after '--': describe -- {dashed[0]!r}"
    print(
        f"hint: argparse reads {dashed[0]!r} as an option; for a pattern that starts with '-', "
        f"{fix}",
        file=sys.stderr,
    )


def _quiet_upstream() -> None:
    """Hide the libraries' import-time warnings and info logs (``--verbose`` shows them).

    megatron-core warns about every optional dependency it falls back from and logs
    deprecations of code paths the user did not choose; none of it is actionable here.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"(megatron|torch|fla|transformer_engine|triton)\b")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _is_settings_error(error: Exception) -> bool:
    """Whether every rank of a job reaches ``error`` alike (bad flags or a bad pattern)."""
    return isinstance(error, (SettingsError, HybridPatternError))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (2 for bad input).

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.
    """
    parser = build_parser(load_commands())
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _reject_unknown(parser, args.command, unknown)
    except SystemExit as exit_:  # argparse: --help/--version (0) or bad flags (2, message printed)
        code = exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
        if code == USAGE_ERROR:
            _pattern_hint(argv)
        return code
    if not getattr(args, "verbose", False):
        _quiet_upstream()
    try:
        return args._run(args)
    except (CommandError, ValueError, ImportError) as error:
        # ImportError: a backend the flags ask for is not installed (e.g. TransformerEngine).
        # Every rank of a torchrun job reaches the same verdict on its settings: one prints it.
        if not _is_settings_error(error) or os.environ.get("RANK", "0") == "0":
            print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error. Point stdout at devnull so the
        # interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:
        # A file-system failure (a full disk, permissions): the writers name the output and
        # leave it as it was; anything else is named with its file.
        print(f"{parser.prog} {args.command}: error: {_os_message(error)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt as interrupt:
        text = str(interrupt) or "interrupted"
        print(f"{parser.prog} {args.command}: {text}", file=sys.stderr)
        return INTERRUPTED


def _os_message(error: OSError) -> str:
    """One line for an ``OSError``: the writers' own messages as they are, others with the
    file they name."""
    if error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return str(error)

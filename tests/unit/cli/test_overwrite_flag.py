"""``--overwrite``: one flag, defined once (``cli/main.py``: ``add_overwrite_flag``), on every
command that writes and on no other; its advice in every refusal is a flag the command has."""

from __future__ import annotations

import argparse

import pytest

from megatron_hybrid.cli.main import build_parser, load_commands

WRITERS = {
    "convert": "--save/--to-hf/--to-peft",
    "train": "--save DIR",
    "logprobs": "--output FILE",
    "prepare-data": "--output-prefix PREFIX",
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(load_commands())
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_writing_command_and_only_those_take_overwrite(command):
    action = _commands()[command]._option_string_actions.get("--overwrite")
    if command not in WRITERS:
        assert action is None
        return
    assert action.option_strings == ["--overwrite"] and action.const is True
    assert action.help.startswith(f"replace what {WRITERS[command]} holds instead of refusing")
    assert "never mixed with it; a source of the command is never replaced" in action.help


def test_the_store_advises_the_flag_every_command_has():
    from megatron_hybrid.checkpointing.outputs import OVERWRITE_ADVICE

    assert "--overwrite " in OVERWRITE_ADVICE and "--overwrite-checkpoint" not in OVERWRITE_ADVICE

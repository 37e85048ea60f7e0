"""``TrainSettings``: the ``train`` flags as one typed, frozen object, made once at the command
line's edge (``settings_from_args``) and read by ``run_training``, ``run_logprobs`` and the rule
table; its fields are the parser's ``dest`` names with the types the parser reads."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from megatron_hybrid.cli.main import _subparser, build_parser, load_commands, main
from megatron_hybrid.training.train_settings import (
    COMMAND_DEFAULTS,
    NOT_FLAGS,
    TrainSettings,
    flag_defaults,
    require_settings,
    settings_from_args,
)

PATTERN = ["--hybrid-layer-pattern", "[*-]{2}"]


def _train_parser() -> argparse.ArgumentParser:
    return _subparser(build_parser(load_commands()), "train")


def _flag_actions() -> dict[str, argparse.Action]:
    """The ``train`` parser's flags by ``dest`` (``--help`` left out)."""
    return {
        action.dest: action
        for action in _train_parser()._actions  # argparse keeps no public registry
        if action.option_strings and action.dest != "help"
    }


def _parsed_type(action: argparse.Action) -> str:
    """The type the parser gives ``action``'s value, written as the field's annotation."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "bool"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool | None"
    base = {int: "int", float: "float", str: "str", None: "str"}[action.type]
    if action.nargs == "+":
        base = f"list[{base}]"
    return f"{base} | None" if action.default is None else base


def _settings(*argv: str) -> TrainSettings:
    return settings_from_args(_train_parser().parse_args([*PATTERN, *argv]))


def test_the_fields_are_the_parsers_flags():
    """One field per flag of ``train`` and no other (besides the two that record how the flags
    were given): a flag added to the parser without its field fails here."""
    fields = [f.name for f in dataclasses.fields(TrainSettings) if f.name not in NOT_FLAGS]
    assert sorted(fields) == sorted(_flag_actions())
    assert len(fields) == len(set(fields))


@pytest.mark.parametrize("dest", sorted(_flag_actions()), ids=str)
def test_each_field_has_the_type_the_parser_reads(dest):
    annotations = {f.name: f.type for f in dataclasses.fields(TrainSettings)}
    assert annotations[dest] == _parsed_type(_flag_actions()[dest])


def test_the_annotations_resolve():
    """The annotations are real types (not strings a reader or a type checker cannot use)."""
    hints = typing.get_type_hints(TrainSettings)
    assert hints["hidden_size"] is int and hints["given"] == frozenset[str]


def test_defaults_are_the_parsers():
    """A namespace of no flags (another command's parser) gets what ``train``'s parser gives;
    ``--lr`` and ``--vocab-size`` are the run-dependent ones ``train`` resolves (None there)."""
    parsed = settings_from_args(_train_parser().parse_args([]))
    bare = settings_from_args(argparse.Namespace())
    differ = {
        f.name
        for f in dataclasses.fields(TrainSettings)
        if getattr(parsed, f.name) != getattr(bare, f.name)
    }
    assert differ == {"lr", "vocab_size"}
    assert (parsed.lr, parsed.vocab_size) == (None, None)
    assert set(COMMAND_DEFAULTS) <= set(flag_defaults())


@pytest.mark.parametrize(
    ("argv", "given"),
    [
        ([], {"hybrid_layer_pattern"}),
        (["--hidden-size", "64"], {"hybrid_layer_pattern", "hidden_size"}),  # the default, given
        (["--swiglu", "--lr", "0.1"], {"hybrid_layer_pattern", "swiglu", "lr"}),
    ],
    ids=["pattern-only", "default-value-given", "switch-and-train-flag"],
)
def test_given_flags_are_carried(argv, given):
    """``given`` holds the package flags typed on the command line, whatever their value."""
    assert _settings(*argv).given == given


def test_given_survives_the_steps_that_complete_the_flags():
    from megatron_hybrid.training.schedule import resolve_schedule

    settings = _settings("--hidden-size", "64")
    replaced = dataclasses.replace(settings, hidden_size=128, vocab_size=512)
    resolved = resolve_schedule(replaced, fine_tuning=True, lora=False)
    assert resolved.given == settings.given == {"hybrid_layer_pattern", "hidden_size"}
    assert (resolved.hidden_size, resolved.lr, settings.hidden_size) == (128, 1e-5, 64)


def test_the_settings_are_frozen():
    settings = _settings()
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field"):
        settings.hidden_size = 32  # type: ignore[misc]


def test_made_once():
    """Settings pass through as they are; other attributes of a command's namespace (its own
    flags, argparse's bookkeeping) are left out."""
    settings = _settings()
    assert settings_from_args(settings) is settings
    namespace = argparse.Namespace(input="x.jsonl", _run=print, hidden_size=32)
    made = settings_from_args(namespace)
    assert made.hidden_size == 32 and not hasattr(made, "input")
    assert made.given == frozenset()  # set by hand: nothing was given on a command line


@pytest.mark.parametrize(
    "taker",
    ["run_training", "validate_settings", "run_logprobs"],
    ids=["run_training", "validate_settings", "run_logprobs"],
)
def test_a_namespace_is_refused_past_the_edge(taker):
    """Negative control: the parsed namespace itself does not travel into ``training``."""
    from megatron_hybrid.training import logprobs_job, run, validation

    namespace = _train_parser().parse_args(PATTERN)
    call = {
        "run_training": lambda: run.run_training(namespace),
        "validate_settings": lambda: validation.validate_settings(namespace),
        "run_logprobs": lambda: logprobs_job.run_logprobs(namespace, None),
    }[taker]
    with pytest.raises(TypeError, match=f"{taker} takes TrainSettings, got Namespace"):
        call()
    assert require_settings(settings_from_args(namespace), taker).hidden_size == 64


class _StopError(ValueError):
    """Ends a command after its settings were taken (exit 2, one message)."""


@pytest.mark.parametrize(
    ("command", "module", "function"),
    [
        (["train", *PATTERN, "--hidden-size", "32"], "run", "run_training"),
        (
            ["logprobs", "--input", "x.jsonl", "--load", "ckpt", "--hidden-size", "32"],
            "logprobs_job",
            "run_logprobs",
        ),
    ],
    ids=["train", "logprobs"],
)
def test_the_command_line_hands_typed_settings_on(command, module, function, monkeypatch, capsys):
    import importlib

    taken = []

    def take(args, *rest, **kwargs):
        taken.append((args, rest))
        raise _StopError("stopped")

    monkeypatch.setattr(importlib.import_module(f"megatron_hybrid.training.{module}"), function,
                        take)  # fmt: skip
    assert main(command) == 2
    assert "stopped" in capsys.readouterr().err
    ((args, rest),) = taken
    assert isinstance(args, TrainSettings)
    assert args.hidden_size == 32 and "hidden_size" in args.given
    if function == "run_logprobs":
        (job,) = rest
        assert (job.input, job.output, job.entropy) == ("x.jsonl", None, False)


def test_the_rule_table_reads_the_typed_flags():
    """The rules read ``s.args.<flag>``: there is no untyped forwarding of flag names."""
    from megatron_hybrid.training.settings import Settings
    from megatron_hybrid.training.validation import SettingsError, validate_settings

    settings = Settings(_settings(), world_size=1, on_gpu=False)
    assert settings.args.hidden_size == 64 and settings.tp == 1
    with pytest.raises(AttributeError, match="hidden_size"):
        settings.hidden_size  # noqa: B018
    bad = dataclasses.replace(_settings(), clip_grad=-1.0)
    with pytest.raises(SettingsError, match=r"--clip-grad -1.0 must be >= 0"):
        validate_settings(bad, world_size=1, on_gpu=False)

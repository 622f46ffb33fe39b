"""``epserve --help`` and every subcommand's help describe every option, each with its default
where it has one (an operator reads the defaults there, as in vLLM's help)."""

from __future__ import annotations

import argparse

import pytest

from epserve.deploy.cli import _parser


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_option_has_a_description_and_its_default(command, capsys):
    sub = _subparsers(_parser())[command]
    for action in sub._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and len(action.help) > 8, f"{command} {name} has no description"
        default = action.default
        if action.option_strings and default not in (None, False) and default is not True:
            shown = sub.formatter_class(prog="x")._get_help_string(action) % {
                "default": default}
            assert "default" in shown, f"{command} {name}: default {default!r} not shown"
    with pytest.raises(SystemExit) as done:
        _parser().parse_args([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "(default: 0)" in text  # --seed's default, which is falsy, is still shown
    assert "--max-num-batched-tokens" in text and "(default: 2048)" in text

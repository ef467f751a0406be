"""Every command's --help, as a user reads it, kept word for word when the command line's code moves (the texts in
tests/data/cli_help/ are the help the single-module command line printed, at 100 columns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsieve.cli import build_parser

HELP = Path(__file__).parent / "data" / "cli_help"
COMMANDS = ["generate", "inspect", "calibrate", "niah", "ruler", "ppl", "bench", "report", "simulate", "methods",
            "demo", "serve"]  # fmt: skip


@pytest.mark.parametrize("command", ["kvsieve", *COMMANDS])
def test_help_is_unchanged(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    argv = [] if command == "kvsieve" else [command]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == (HELP / f"{command}.txt").read_text()


def test_every_command_has_its_help_text():
    choices = build_parser()._subparsers._group_actions[0].choices
    assert sorted(choices) == sorted(COMMANDS)

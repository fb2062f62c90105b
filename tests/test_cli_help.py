"""`mlcc --help` and every subcommand's: each flag says what it does, and its default where it has one."""

from __future__ import annotations

import argparse
import subprocess
import sys

from mlcc.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "mlcc"):
    """(command line, parser) for `parser` and every subcommand under it, nested ones (`mlcc bench serve`) too."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _says_nothing(action: argparse.Action) -> bool:
    """No default to show: none, or a switch (whose default is simply off)."""
    return action.nargs == 0 or action.default in (None, False, [], argparse.SUPPRESS)


def test_every_flag_has_help_and_shows_its_default():
    missing, no_default = [], []
    commands = list(_parsers(build_parser()))
    assert {"mlcc chat", "mlcc serve", "mlcc compile", "mlcc tune", "mlcc bench serve"} <= {c for c, _ in commands}
    for command, parser in commands:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            flag = f"{command} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(flag)
            elif action.option_strings and not _says_nothing(action) and \
                    "default" not in formatter._get_help_string(action):
                no_default.append(flag)
    assert not missing, f"flags without help: {missing}"
    assert not no_default, f"flags whose help hides their default: {no_default}"


def _help(command: str) -> str:
    """`mlcc COMMAND --help`, its lines joined (argparse wraps them at the terminal's width)."""
    return " ".join(subprocess.run([sys.executable, "-m", "mlcc", command, "--help"], capture_output=True, text=True,
                                   check=True).stdout.split())


def test_help_shows_defaults():
    out = _help("tune")
    assert "(default: 64)" in out and "(default: llvm)" in out   # --trials, --target
    out = _help("serve")
    assert "(default: 8000)" in out and "Hugging Face repo name" in out
    assert "prefix cache" not in out or "(default: True)" not in out   # a switch shows no default

"""What a command's error may name: only options that command has."""

from __future__ import annotations

import argparse
import re


def command_options(command: str) -> set[str]:
    """The option strings of ``usp COMMAND`` (its parser, as ``usp`` builds it)."""
    from usp.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices[command]._option_string_actions)


def assert_flags_are_the_commands(message: str, command: str) -> set[str]:
    """Every ``--flag`` ``message`` names is one of ``usp COMMAND``'s options (and it
    names at least one); returns them."""
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", message))
    unknown = named - command_options(command)
    assert named and not unknown, (unknown, message)
    return named

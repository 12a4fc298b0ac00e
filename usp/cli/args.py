"""argparse value types shared by every ``usp`` subcommand (a leaf: no subcommand
imports another's module for them)."""

from __future__ import annotations

import argparse

#: ``usp.config.toml.AUTO`` (not imported from there: the config package loads torch,
#: and a usage error answers before torch loads; tests/planner/test_planner_cli.py checks
#: they agree)
AUTO = "auto"
#: the keys of ``usp.train.components.TORCH_DTYPES`` (not imported from there: it loads
#: torch; tests/tools/test_light_cli.py checks they agree): ``usp eval --dtype``'s choices
DTYPE_NAMES = ("float32", "bfloat16")


def int_or_auto(text: str) -> int | str:
    """argparse type: an integer >= 1 or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected an integer or "auto", got {text!r}') from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def at_most(kind, maximum, why: str):
    """An argparse type: ``kind`` (:func:`positive_int` or :func:`positive_float`) no
    larger than ``maximum``; ``why`` says what the bound is (one line, exit 2)."""

    def parse(text: str):
        value = kind(text)
        if value > maximum:
            shown = f"{maximum:,.0f}" if float(maximum).is_integer() else f"{maximum:g}"
            raise argparse.ArgumentTypeError(f"{text} is past {shown}: {why}")
        return value

    parse.__name__ = kind.__name__  # (argparse names the type in its messages)
    return parse


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable): any config field (usp.config.overrides)."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set any config field, checked as in the file; VALUE is a TOML value (a bare "
        "word is a string); repeatable, e.g. --set train.lr=1e-4 --set data.long_documents=split",
    )

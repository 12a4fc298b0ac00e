"""The ``usp`` command line (also ``python -m usp``).

Each subcommand lives in its own module with an ``add_parser(subparsers)`` function that
registers it with ``set_defaults(run=...)``; ``run(args) -> int`` returns the exit
status. :data:`SUBCOMMANDS` names those modules in the order ``usp --help`` shows them
(imported when the parser is built): adding a command is one entry there.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# New subcommands: append the module that holds their add_parser here.
SUBCOMMANDS = (
    "usp.cli.topo",
    "usp.cli.train",
    "usp.planner.cli",
    "usp.cli.eval",
    "usp.cli.data",
)
#: subcommands whose module imports no torch until it runs: ``usp plan --bad-flag``
#: answers from a parser of that command alone, before torch loads, and ``usp train
#: --nproc-per-node N``'s and ``usp eval ... --nproc-per-node N``'s launchers start
#: without the training or evaluation stack (tests/tools/test_light_cli.py)
LIGHT = {"plan": "usp.planner.cli", "train": "usp.cli.train", "eval": "usp.cli.eval"}


def build_parser(modules: tuple[str, ...] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """The ``usp`` parser with the subcommands of ``modules`` (default: all of
    :data:`SUBCOMMANDS`)."""
    parser = argparse.ArgumentParser(
        prog="usp", description="usp: hybrid sequence parallelism (Ulysses x ring attention)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in modules:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; its exit status.
    A command of :data:`LIGHT` is parsed by its own parser alone (no torch import)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    light = LIGHT.get(argv[0]) if argv else None
    args = build_parser((light,) if light else SUBCOMMANDS).parse_args(argv)
    return args.run(args)


__all__ = ["LIGHT", "SUBCOMMANDS", "build_parser", "main"]

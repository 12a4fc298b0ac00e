"""The ``usp`` command line (also ``python -m usp``).

Each subcommand lives in its own module with an ``add_parser(subparsers)`` function that
registers it with ``set_defaults(run=...)``; ``run(args) -> int`` returns the exit
status. :data:`SUBCOMMANDS` lists them in the order ``usp --help`` shows them: adding a
command is one import and one entry there.
"""

from __future__ import annotations

import argparse

from usp.cli.data import add_parser as add_data_parser
from usp.cli.topo import add_parser as add_topo_parser
from usp.cli.train import add_parser as add_train_parser
from usp.evaluation.cli import add_parser as add_eval_parser
from usp.planner.cli import add_parser as add_plan_parser

# New subcommands: import their add_parser above and append it here.
SUBCOMMANDS = (
    add_topo_parser,
    add_train_parser,
    add_plan_parser,
    add_eval_parser,
    add_data_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``usp`` parser with every subcommand of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="usp", description="usp: hybrid sequence parallelism (Ulysses x ring attention)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; its exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


__all__ = ["SUBCOMMANDS", "build_parser", "main"]

"""``usp data CONFIG``: the rows the trainer would see, decoded, trained spans marked.

    usp data examples/configs/cpu_finetune.toml --rows 2
    usp data job.toml --set data.long_documents=split --json

The trainer's own pipeline and cache (:mod:`usp.train.data_view`): the data is tokenised
into the output directory's cache if it is not there yet, and ``usp train`` then reuses
it. Exit status: 0 shown, 2 a config or data error (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from usp.cli.args import add_set_argument, positive_int
from usp.train.config import load_train_config
from usp.train.data_view import view_data, view_text
from usp.train.setup import user_errors


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``data`` on the ``usp`` command line."""
    p = subparsers.add_parser(
        "data",
        help="show the packed rows a training config feeds the model, trained spans marked",
        description="Decode the first packed rows usp train would train on (same pipeline, "
        "same cache), mark the tokens that carry loss, and count documents and tokens per "
        "data file.",
    )
    p.add_argument("config", help="a usp train config (TOML)")
    p.add_argument("--rows", type=positive_int, default=2, help="rows shown (default 2)")
    p.add_argument("--json", action="store_true", help="machine-readable output (full text)")
    p.add_argument("--full", action="store_true", help="do not shorten long spans")
    p.add_argument("--output", help="output directory, whose cache is used (as usp train's)")
    p.add_argument(
        "--world-size", type=positive_int, help='ranks, for a [cluster] of "auto" values'
    )
    add_set_argument(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        job = load_train_config(args.config, sets=args.sets, output_dir=args.output)
        view = view_data(job, rows=args.rows, world_size=args.world_size)
    except user_errors() as err:
        print(f"usp data: error: {err}", file=sys.stderr)
        return 2
    print(
        json.dumps(view, indent=1, ensure_ascii=False)
        if args.json
        else view_text(view, full=args.full)
    )
    return 0

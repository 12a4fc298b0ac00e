"""``usp eval TARGET --lengths 4096,16384``: the flags; the command itself is
:func:`usp.evaluation.cli.run`.

This module imports no torch: ``usp eval`` parses its flags, and its launcher
(``--nproc-per-node``) starts, before the evaluation stack loads (only the workers load it).
"""

from __future__ import annotations

import argparse
import functools

from usp.cli.args import AUTO, DTYPE_NAMES, int_or_auto, positive_int
from usp.cli.launch import add_launch_arguments, launch, wants_launcher


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers (e.g. 4096,16384), got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _depth_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers in [0, 1] (e.g. 0,0.5,1), got {text!r}"
        ) from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``usp`` command line (``set_defaults(run=run)``)."""
    p = subparsers.add_parser(
        "eval",
        help="long-context check of a trained model: perplexity by position, passkey retrieval",
        description="Forward-only evaluation of a training output directory (its newest "
        "checkpoint) or an HF model directory at several sequence lengths, under torchrun "
        "for lengths beyond one device: torchrun --nproc-per-node N -m usp eval TARGET ..., "
        "or usp eval TARGET ... --nproc-per-node N (the launcher in this process).",
    )
    p.add_argument("target", help="training output directory, one checkpoint, or HF directory")
    p.add_argument("--config", help="the training config (required for a training output)")
    p.add_argument(
        "--data", nargs="+", metavar="FILE", help="held-out JSONL files (default: [eval] files)"
    )
    p.add_argument("--lengths", type=_int_list, required=True, help="e.g. 4096,16384")
    p.add_argument("--passkey", action="store_true", help="also run passkey retrieval")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--buckets", type=positive_int, default=8, help="position buckets (8)")
    p.add_argument("--windows", type=positive_int, default=4, help="windows per length (4)")
    # default None: usp.evaluation.runner.DEFAULT_DEPTHS, read where the command runs
    p.add_argument("--depths", type=_depth_list, help="passkey depths (0,.25,...,1)")
    p.add_argument("--trials", type=positive_int, default=4, help="passkeys per cell (4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys (0)")
    p.add_argument("--tokenizer", help='"byte" or a tokenizer.json (default: the model\'s)')
    p.add_argument("--output", help="where eval.json and the plots go (default: TARGET/eval)")
    p.add_argument("--ulysses", type=int_or_auto, help='Ulysses degree, int or "auto"')
    p.add_argument("--ring", type=int_or_auto, help='ring degree, int or "auto"')
    p.add_argument("--dp", type=int_or_auto, help="replicas sharing the sequences (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=[AUTO, *DTYPE_NAMES], default=AUTO, help="bf16 on CUDA")
    add_launch_arguments(p)
    p.set_defaults(run=functools.partial(run, parser=p))
    return p


def run(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    """``usp eval``: this process's part, or (``--nproc-per-node``) the launcher that starts
    every worker (:mod:`usp.cli.launch`)."""
    if wants_launcher(args):
        return launch(parser, args, "eval")
    from usp.evaluation.cli import run as run_eval  # the evaluation stack: torch and the rest

    return run_eval(args)

"""``usp train CONFIG``: the flags; the command itself is :func:`usp.train.cli.run`.

This module imports no torch: ``usp train`` parses its flags, and its launcher
(``--nproc-per-node``) starts, before the training stack loads (only the workers load it).
"""

from __future__ import annotations

import argparse
import functools

from usp.cli.args import add_set_argument, int_or_auto, positive_int
from usp.cli.launch import add_launch_arguments, launch, wants_launcher


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train`` on the ``usp`` command line (``set_defaults(run=run)``)."""
    p = subparsers.add_parser(
        "train",
        help="fine-tune a Llama, Qwen2/2.5, Qwen3 or Mistral model under USP (launch with torchrun)",
        description="Fine-tune a Llama, Qwen or Mistral model with FSDP2 over dp x (ulysses x ring). "
        "Launch: torchrun --nproc-per-node N -m usp train CONFIG, or usp train CONFIG "
        "--nproc-per-node N (torchrun's launcher in this process; the first failing rank's "
        "error is the last line printed).",
    )
    p.add_argument(
        "config",
        help="training config (TOML: [cluster] [parallel] [attention] [model] [data] [train])",
    )
    p.add_argument("--steps", type=positive_int, help="optimizer steps (overrides [train] steps)")
    p.add_argument("--output", help="output directory (overrides [train] output_dir)")
    p.add_argument("--ulysses", type=int_or_auto, help='Ulysses degree, int or "auto"')
    p.add_argument("--ring", type=int_or_auto, help='ring degree, int or "auto"')
    p.add_argument("--dp", type=int_or_auto, help='data-parallel replicas, int or "auto"')
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in the output directory (step 0 if none)",
    )
    p.add_argument(
        "--resume-changed",
        action="store_true",
        help="with --resume: accept a run whose seed, data, seq_len, global_batch or RoPE "
        "differ from the checkpoint's",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="overrides [train] device")
    add_set_argument(p)
    add_launch_arguments(p)
    p.set_defaults(run=functools.partial(run, parser=p))
    return p


def run(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    """``usp train``: this process's part of the job, or (``--nproc-per-node``) the
    launcher that starts every worker (:mod:`usp.cli.launch`)."""
    if wants_launcher(args):
        return launch(parser, args)
    from usp.train.cli import run as run_train  # the training stack: torch and the rest

    return run_train(args)

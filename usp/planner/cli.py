"""``usp plan CONFIG``: what fits, and how fast, before anyone books a cluster.

    usp plan examples/configs/llama3_8b_1m.toml
    usp plan examples/configs/llama3_8b_128k.toml --seq-len 1048576 --nodes 1 --json

Reads a ``usp train`` config (the model from its preset or its checkpoint's
``config.json``; the cluster from ``[cluster]``; ``[train]``/``[attention]`` as they
are), measures one rank's real training step for every valid grid and memory option
(:mod:`usp.planner.search`), and prints them ranked by estimated step time with the
longest sequence that fits; what it measures is shown on stderr as it goes (n of m;
``--quiet``: nothing). Exit status: 0 a plan fits, 2 bad input or nothing fits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from usp.cli.args import add_set_argument, positive_float, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``usp`` command line (``set_defaults(run=run)``)."""
    from usp.planner.pool import default_jobs
    from usp.planner.search import DEFAULT_GPU, DEFAULT_HOST_MEMORY_GIB, GPU_MEMORY_GIB

    p = subparsers.add_parser(
        "plan",
        help="measure what fits (memory per rank, step time, longest sequence) for a config",
        description="Run one rank's training step under fake tensors for every valid "
        "(ulysses, ring, dp) and activation-memory option, and rank them.",
    )
    p.add_argument("config", help="a usp train config (TOML)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence ([train] seq_len)")
    p.add_argument("--nodes", type=positive_int, help="overrides [cluster] nodes")
    p.add_argument("--gpus-per-node", type=positive_int, help="overrides [cluster] gpus_per_node")
    p.add_argument(
        "--gpu-memory-gib",
        type=positive_float,
        help=f"memory per GPU (default: the [cluster] gpu's, {GPU_MEMORY_GIB[DEFAULT_GPU]:g} "
        f"for {DEFAULT_GPU}; known: {', '.join(f'{k} {v:g}' for k, v in GPU_MEMORY_GIB.items())})",
    )
    p.add_argument(
        "--host-memory-gib",
        type=positive_float,
        help=f"host memory per node (default {DEFAULT_HOST_MEMORY_GIB:g})",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help='the run planned (default: [train] device, "cuda" for "auto")',
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=default_jobs(),
        help="worker processes measuring in parallel (default: min(2, CPUs) = "
        f"{default_jobs()}; 1 measures in this process); the result does not depend on it",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr while it measures"
    )
    add_set_argument(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from usp.errors import UspError
    from usp.planner.plan import nothing_fits, plan

    started = time.perf_counter()
    try:
        result = plan(
            args.config,
            seq_len=args.seq_len,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            host_memory_gib=args.host_memory_gib,
            device=args.device,
            started=started,
            jobs=args.jobs,
            sets=getattr(args, "sets", None) or (),
            progress=None if getattr(args, "quiet", False) else _progress,
        )
    except UspError as err:
        print(f"usp plan: error: {err}", file=sys.stderr)
        return 2
    _show(result, args.json)
    if result.best is None:
        print(f"usp plan: error: {nothing_fits(result)}", file=sys.stderr)
        return 2
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _show(result, as_json: bool) -> None:
    from usp.planner.report import text, to_json

    if as_json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(text(result))

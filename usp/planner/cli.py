"""``usp plan CONFIG``: what fits, and how fast, before anyone books a cluster.

    usp plan examples/configs/llama3_8b_1m.toml
    usp plan examples/configs/llama3_8b_128k.toml --seq-len 1048576 --nodes 1 --json

Reads a ``usp train`` config (the model from its preset or its checkpoint's
``config.json``; the cluster from ``[cluster]``; ``[train]``/``[attention]`` as they
are), measures one rank's real training step for every valid grid and memory option
(:mod:`usp.planner.search`), and prints them ranked by estimated step time with the
longest sequence that fits; what it measures is shown on stderr as it goes (n of m;
``--quiet``: nothing). Exit status: 0 a plan fits, 2 bad input or nothing fits, 128 + N
when signal N (SIGINT, SIGTERM) stopped it -- its worker processes stopped first.

This module imports no torch until :func:`run` (a usage error, a value past what the
plan can represent, answers at once: :data:`usp.cli.LIGHT`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from usp.cli.args import add_set_argument, at_most, positive_float, positive_int
from usp.errors import UspError
from usp.planner.hardware import (
    DEFAULT_GPU,
    DEFAULT_HOST_MEMORY_GIB,
    GPU_MEMORY_GIB,
    MAX_JOBS,
    MAX_MEMORY_GIB,
    MAX_ROW_TOKENS,
    MAX_WORLD,
    default_jobs,
)

_ROW = "a packed row's document boundaries are int32"
_WORLD = "the plan enumerates every (ulysses, ring, dp) of at most that many ranks"
_MEMORY = "GiB; the plan's byte arithmetic is exact only below that"


class PlanStopped(BaseException):
    """A signal stopped ``usp plan`` (raised in its main thread; not an Exception, so no
    ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``usp`` command line (``set_defaults(run=run)``)."""

    p = subparsers.add_parser(
        "plan",
        help="measure what fits (memory per rank, step time, longest sequence) for a config",
        description="Run one rank's training step under fake tensors for every valid "
        "(ulysses, ring, dp) and activation-memory option, and rank them.",
    )
    p.add_argument("config", help="a usp train config (TOML)")
    p.add_argument(
        "--seq-len",
        type=at_most(positive_int, MAX_ROW_TOKENS, _ROW),
        help="tokens per sequence ([train] seq_len)",
    )
    p.add_argument(
        "--nodes", type=at_most(positive_int, MAX_WORLD, _WORLD), help="overrides [cluster] nodes"
    )
    p.add_argument(
        "--gpus-per-node",
        type=at_most(positive_int, MAX_WORLD, _WORLD),
        help="overrides [cluster] gpus_per_node",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=at_most(positive_float, MAX_MEMORY_GIB, _MEMORY),
        help=f"memory per GPU (default: the [cluster] gpu's, {GPU_MEMORY_GIB[DEFAULT_GPU]:g} "
        f"for {DEFAULT_GPU}; known: {', '.join(f'{k} {v:g}' for k, v in GPU_MEMORY_GIB.items())})",
    )
    p.add_argument(
        "--host-memory-gib",
        type=at_most(positive_float, MAX_MEMORY_GIB, _MEMORY),
        help=f"host memory per node (default {DEFAULT_HOST_MEMORY_GIB:g})",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help='the run planned (default: [train] device, "cuda" for "auto")',
    )
    p.add_argument(
        "--jobs",
        type=at_most(positive_int, MAX_JOBS, "at most one worker per CPU here"),
        default=default_jobs(),
        help="worker processes measuring in parallel (default: min(2, CPUs) = "
        f"{default_jobs()}; 1 measures in this process); the result does not depend on it",
    )
    p.add_argument(
        "--lengths",
        help="a length mix, one document length a line (or 'data': the config's own "
        "training data): the best layout's step on its rows, both token placements",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr while it measures"
    )
    add_set_argument(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    with _stop_on_signals():
        try:
            return _run(args, started)
        except PlanStopped as stop:
            name = signal.Signals(stop.signum).name
            print(f"usp plan: stopped by {name} (its worker processes were stopped)",
                  file=sys.stderr)  # fmt: skip
            return 128 + stop.signum


class _stop_on_signals:
    """While inside (in the main thread): SIGTERM and SIGINT raise :class:`PlanStopped`,
    so the measurements' context ends its workers before the command exits."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise PlanStopped(signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace, started: float) -> int:
    from usp.planner.plan import nothing_fits, plan

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
            lengths=_lengths(getattr(args, "lengths", None)),
        )
    except UspError as err:
        print(f"usp plan: error: {err}", file=sys.stderr)
        return 2
    _show(result, args.json)
    if result.best is None:
        print(f"usp plan: error: {nothing_fits(result)}", file=sys.stderr)
        return 2
    return 0


def _lengths(path: str | None):
    """``--lengths``: None, ``"data"``, or the file's lengths (one a line)."""
    if path is None or path == "data":
        return path
    try:
        with open(path) as f:
            lines = [line.strip() for line in f]
    except OSError as err:
        raise UspError(f"--lengths {path}: {err.strerror}") from None
    out = []
    for number, text in enumerate(lines, 1):
        if text and (not text.isdigit() or int(text) < 1):
            raise UspError(
                f"--lengths {path}:{number}: expected a document length >= 1, got {text!r}"
            )
        if text:
            out.append(int(text))
    if not out:
        raise UspError(f"--lengths {path}: no document lengths")
    return out


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _show(result, as_json: bool) -> None:
    from usp.planner.report import text, to_json

    if as_json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(text(result))

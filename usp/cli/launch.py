"""``usp train CONFIG --nproc-per-node N`` (and ``usp eval TARGET ... --nproc-per-node N``):
torchrun's launcher, run in this process.

The same machinery as ``torchrun --nproc-per-node N -m usp train CONFIG`` (torch's
``torch.distributed.run``: rendezvous, worker processes, their environment), with one
difference at the end: when a worker fails, torchrun prints its failure table and a
traceback of its own, so the one useful line sits ~40 lines up; here the first failing
rank's usp error (:mod:`usp.train.error_file`) is the last line printed, and the exit
status is that rank's (2 a config or data error, 3 diverged, 4 a collective failed, ...;
128+N for a rank killed by signal N). A rank that dies after its run finished (every
failed rank recorded that it had finished) is not a failed run: the last line says the
run finished and which rank died at exit, and the status is 0.

Multi-node: ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port`` as
torchrun has them; for anything else (elastic rendezvous, restarts) use torchrun itself.
"""

from __future__ import annotations

import argparse
import os
import sys

from usp.cli.args import positive_int
from usp.train.error_file import read_error_data

#: the flags of the launcher form (argparse dests); a worker gets every other flag
LAUNCH_DESTS = (
    "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "shutdown_timeout",
)  # fmt: skip
#: seconds the workers get after a SIGTERM before torchrun kills them: one step plus one
#: checkpoint save (torchrun's own default, 30 s, covers only small models)
DEFAULT_SHUTDOWN_TIMEOUT_S = 300


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "launcher (instead of torchrun)",
        "with --nproc-per-node, usp starts the worker processes itself with torchrun's "
        "machinery and prints the first failing rank's error last",
    )
    group.add_argument("--nproc-per-node", type=positive_int, help="worker processes per node")
    group.add_argument("--nnodes", type=positive_int, help="nodes (default 1)")
    group.add_argument("--node-rank", type=int, help="this node's rank (default 0)")
    group.add_argument("--master-addr", help="rank 0's node address (multi-node)")
    group.add_argument("--master-port", type=int, help="rank 0's port (multi-node)")
    group.add_argument(
        "--shutdown-timeout",
        type=positive_int,
        help="seconds the workers get to finish a step and save after a SIGTERM before they "
        f"are killed (default {DEFAULT_SHUTDOWN_TIMEOUT_S}; torchrun's own is 30)",
    )


def wants_launcher(args: argparse.Namespace) -> bool:
    return getattr(args, "nproc_per_node", None) is not None


def worker_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command line a worker runs (the command's positional and every flag given, but
    the launcher's), rebuilt from ``parser``'s own options so no flag is forgotten: a
    list of values (``nargs``) as its items, a tuple a flag's type made from one
    comma-separated value (``--lengths 256,1024``) joined back."""
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list
        if isinstance(action, argparse._HelpAction) or action.dest in LAUNCH_DESTS:
            continue
        value = getattr(args, action.dest, None)
        if not action.option_strings:  # the positional path (config, target)
            argv.append(str(value))
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            for item in value or ():
                argv += [flag, str(item)]
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            argv += [flag, *(str(item) for item in value)]
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(item) for item in value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _torchrun_args(args: argparse.Namespace, command: list[str]) -> list[str]:
    launch = ["--nproc-per-node", str(args.nproc_per_node)]
    nodes = args.nnodes or 1
    launch += ["--nnodes", str(nodes), "--node-rank", str(args.node_rank or 0)]
    if args.master_addr is not None:
        launch += ["--master-addr", args.master_addr]
    if args.master_port is not None:
        launch += ["--master-port", str(args.master_port)]
    if nodes == 1 and args.master_port is None:
        launch += ["--standalone"]  # a free port of this machine
    launch += ["--shutdown-timeout", str(args.shutdown_timeout or DEFAULT_SHUTDOWN_TIMEOUT_S)]
    return [*launch, "--module", "usp", *command]


def launch(
    parser: argparse.ArgumentParser, args: argparse.Namespace, command: str = "train"
) -> int:
    """Run ``usp COMMAND`` (train, eval) under torchrun's launcher here; the exit status
    (see module doc)."""
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        print(
            f"usp {command}: error: --nproc-per-node starts the workers itself; under "
            "torchrun (which already did) leave it out",
            file=sys.stderr,
        )
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    worker = [command, *worker_argv(parser, args)]
    try:
        torchrun(get_args_parser().parse_args(_torchrun_args(args, worker)))
    except ChildFailedError as err:
        line = died_after_finishing(err.failures, command)
        if line is not None:  # the outputs are complete: not a failed run
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
            return 0
        line, status = first_failure(err.failures, command)
    except SignalException as err:  # the launcher was signalled; torchrun stopped the workers
        signal = int(err.sigval)
        line = (
            f"usp {command}: the launcher got {err.sigval.name}; the workers were sent it too"
            + (
                " (any checkpoint they saved is named above; --resume continues from it)"
                if command == "train"
                else ""
            )
        )
        status = 128 + signal
    else:
        return 0
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    return status


def died_after_finishing(failures: dict, command: str = "train") -> str | None:
    """The line for a run that finished, and whose failed ranks died only afterwards (at
    exit): every failed rank recorded that its run had finished
    (:data:`usp.train.error_file.FINISHED`) before tearing down; the ranks that did not
    fail exited 0. None when some failed rank had not finished."""
    recorded = [read_error_data(f.error_file_data) for f in failures.values()]
    if not failures or not all(r is not None and r.finished for r in recorded):
        return None
    died = "; ".join(_what_happened(rank, failures[rank]) for rank in sorted(failures))
    return (
        f"usp {command}: the run finished on every rank (its summary above says where the "
        f"outputs are); afterwards, at exit, {died}. Its outputs are complete; please "
        "report the rank's output above"
    )


def _what_happened(rank: int, failure) -> str:
    """What torchrun saw of a rank: the signal that killed it or its exit status."""
    if failure.exitcode < 0:
        return (
            f"rank {rank} (pid {failure.pid}) was killed by signal {-failure.exitcode} "
            f"({failure.signal_name()})"
        )
    return f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}"


def first_failure(failures: dict, command: str = "train") -> tuple[str, int]:
    """The line and exit status of the rank that failed first (``failures``: torchrun's
    ``{global rank: ProcessFailure}``): usp's recorded error where a rank wrote one (a
    finished rank's record is not an error), else what torchrun saw (a signal, an exit
    status)."""
    recorded = {rank: read_error_data(f.error_file_data) for rank, f in failures.items()}
    with_line = {rank: r for rank, r in recorded.items() if r is not None and not r.finished}
    if with_line:
        rank = min(with_line, key=lambda r: (with_line[r].time, r))
        return with_line[rank].message, with_line[rank].status
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    failure = failures[rank]
    what = _what_happened(rank, failure)
    if failure.exitcode < 0:
        return (
            f"usp {command}: error: {what}; its output above says what it was doing",
            128 - failure.exitcode,
        )
    return f"usp {command}: error: {what}; its output above says why", failure.exitcode or 1

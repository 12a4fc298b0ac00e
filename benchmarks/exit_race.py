"""The abort at exit, made on purpose, with and without usp's quiet wait.

    python benchmarks/exit_race.py --runs 15

A rank aborts at interpreter shutdown ("terminate called without an active exception")
when a gloo worker thread is the last owner of a Python-made tensor as the interpreter
shuts down: freeing it needs the GIL, and a thread that asks for it then is stopped
inside a C++ destructor. In a finished ``usp train`` run a worker gets there only when it
is starved on a loaded machine (rare: ``benchmarks/resume_soak.py`` counts real runs).
Here the same state is made on purpose: two gloo ranks (two processes, a file store)
start an all-reduce of ``--mb`` MB on gloo's worker thread, drop the tensor and the work
at once, and leave -- directly (``exit``), or after
:func:`usp.process_groups.shutdown.wait_for_quiet_threads` (``wait``, what ``usp
train``'s teardown runs before its last barriers). ``--runs`` pairs of each, interleaved
(a shared machine's load hits both alike). Prints one JSON line per pair and the counts;
results: ``benchmarks/README.md``, *Resume and exit soak*.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABORT = "terminate called"


def rank_main(rank: int, mode: str, store: str, mb: float) -> None:
    """One rank: the all-reduce left to gloo's worker thread, then leave."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    tensor = torch.ones(int(mb * 2**20) // 4)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor, work  # the worker thread is now the tensor's last owner
    if mode == "wait":
        sys.path.insert(0, str(ROOT))
        from usp.process_groups.shutdown import wait_for_quiet_threads

        wait_for_quiet_threads()


def run_pair(mode: str, mb: float, directory: Path, index: int) -> dict:
    """Both ranks of one run; what became of them."""
    store = directory / f"store-{mode}-{index}"
    command = [sys.executable, __file__, "--mode", mode, "--mb", str(mb), "--store", str(store)]
    ranks = [
        subprocess.Popen(
            [*command, "--rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=600)[0] for rank in ranks]
    statuses = [rank.returncode for rank in ranks]
    return {
        "mode": mode,
        "statuses": statuses,
        "aborted": any(ABORT in out for out in outputs),
        "failed": any(statuses),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="pairs of ranks per mode (15)")
    parser.add_argument("--mb", type=float, default=8.0, help="the all-reduce's size (8 MB)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["exit", "wait"], help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.mode, args.store, args.mb)
        return {}
    counts = {mode: {"runs": 0, "aborted": 0, "failed": 0} for mode in ("exit", "wait")}
    with tempfile.TemporaryDirectory(prefix="usp-exit-race-") as directory:
        for index in range(args.runs):
            for mode in ("exit", "wait"):
                result = run_pair(mode, args.mb, Path(directory), index)
                print(json.dumps(result), flush=True)
                counts[mode]["runs"] += 1
                counts[mode]["aborted"] += result["aborted"]
                counts[mode]["failed"] += result["failed"]
    print(json.dumps({"summary": counts}), flush=True)
    return counts


if __name__ == "__main__":
    main()

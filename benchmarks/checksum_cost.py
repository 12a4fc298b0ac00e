"""What the integrity checksums cost (:mod:`usp.train.checksums`): hashing throughput,
and the checksums of a checkpoint against its DCP save and load, side by side in one run.

    python benchmarks/checksum_cost.py --mb 512 --threads 1 2 --repeats 3

One process writes a state dict of ``--mb`` MB of float32 tensors (16 MiB each, like
the shards of a large model) with ``torch.distributed.checkpoint`` into ``--dir``, then
times ``dcp.save`` and ``dcp.load`` and, per thread count, :func:`record_checksums`
(what every rank runs after its save) and :func:`verify_checksums` (what every rank runs
before a load); CRC-32 and SHA-256 of the same bytes in memory show what the CPU gives
at that moment.
Files are hashed right after being written or read, from the page cache, as in
training. Prints one JSON line per measurement (medians of ``--repeats``) and a summary
line with MB/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from usp.train.checkpoint_integrity import record_checksums, verify_checksums


def _median_seconds(fn, repeats: int, before=None) -> float:
    """The median over ``repeats`` of ``fn``'s seconds (``before`` runs untimed first)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _evict(directory: Path) -> None:
    """Drop the directory's files from the page cache (they are clean: DCP fsyncs), so
    the next read comes from the disk, as at the start of a job."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the measurements; returns ``{what: seconds}`` (also printed, one JSON line each)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=512.0, help="checkpoint size, MB")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    args = parser.parse_args(argv)
    # one process on purpose: DCP's note that it assumes so is noise here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="usp-checksum-cost-"))
    try:
        numel = 4 << 20  # 16 MiB of float32 per tensor
        count = max(1, round(args.mb * 1e6 / (numel * 4)))
        gen = torch.Generator().manual_seed(0)
        state = {f"w{i}": torch.randn(numel, generator=gen) for i in range(count)}
        mb = round(count * numel * 4 / 1e6, 1)
        path = root / "step"
        target = {k: torch.empty_like(v) for k, v in state.items()}

        def save():
            shutil.rmtree(path, ignore_errors=True)
            return dcp.save(state, checkpoint_id=str(path), no_dist=True)

        def load():
            dcp.load(target, checkpoint_id=str(path), no_dist=True)

        seconds = {"dcp.save": _median_seconds(save, args.repeats)}
        metadata = save()
        seconds["dcp.load (page cache)"] = _median_seconds(load, args.repeats)
        seconds["dcp.load (from disk)"] = _median_seconds(load, args.repeats, lambda: _evict(path))
        assert all(torch.equal(target[k], state[k]) for k in state)
        for threads in args.threads:
            torch.set_num_threads(threads)
            recorded = record_checksums(path, metadata)[0]

            def verify(recorded=recorded):
                verify_checksums(path, recorded)

            def verify_then_load(recorded=recorded):
                verify_checksums(path, recorded)
                load()

            seconds[f"record_checksums x{threads} (after the save)"] = _median_seconds(
                lambda: record_checksums(path, metadata), args.repeats
            )
            seconds[f"verify_checksums x{threads} (page cache)"] = _median_seconds(
                verify, args.repeats
            )
            seconds[f"verify_checksums x{threads} + dcp.load (from disk)"] = _median_seconds(
                verify_then_load, args.repeats, lambda: _evict(path)
            )
        for what, value in seconds.items():
            print(json.dumps({"what": what, "mb": mb, "seconds": round(value, 3),
                              "mb_per_s": round(mb / value)}))  # fmt: skip
        # what one core gives at the moment (a shared machine's load varies): the same
        # bytes in memory, the checksums' CRC-32 next to SHA-256
        blob = memoryview(os.urandom(min(int(mb * 1e6), 256 << 20)))
        speeds = {}
        for what, fn in (("crc32", zlib.crc32), ("sha256", lambda b: hashlib.sha256(b).digest())):
            speeds[what] = len(blob) / 1e6 / _median_seconds(lambda fn=fn: fn(blob), args.repeats)
            print(
                json.dumps(
                    {"what": f"{what} in memory, one thread", "mb_per_s": round(speeds[what])}
                )
            )
        t = args.threads[0]
        save_cost = seconds[f"record_checksums x{t} (after the save)"] / seconds["dcp.save"]
        cold = seconds["dcp.load (from disk)"]
        load_cost = seconds[f"verify_checksums x{t} + dcp.load (from disk)"] / cold - 1
        print(
            f"{mb:.0f} MB, {t} thread(s): the checksums add {100 * save_cost:.0f}% to a save "
            f"({seconds['dcp.save']:.2f} s) and {100 * load_cost:.0f}% to a load from disk "
            f"({cold:.2f} s); one core: crc32 {speeds['crc32']:.0f} MB/s, sha256 "
            f"{speeds['sha256']:.0f} MB/s in memory"
        )
        return seconds
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

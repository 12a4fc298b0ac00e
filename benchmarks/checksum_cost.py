"""What the integrity checksums cost (:mod:`usp.train.checksums`): hashing throughput,
and the checksums of a checkpoint against its DCP save and load, side by side in one run.

    python benchmarks/checksum_cost.py --mb 512 --threads 1 2 --repeats 7

One process writes a state dict of ``--mb`` MB of float32 tensors (16 MiB each) with
``torch.distributed.checkpoint`` into ``--dir``. Each of ``--repeats`` rounds times, one
after the other (so a shared machine's changing load hits all alike): ``dcp.save``, then
per thread count :func:`record_checksums` (what every rank runs right after its save:
its files are in the page cache); ``dcp.load`` from the disk (the files dropped from the
page cache first), then per thread count :func:`verify_checksums` followed by
``dcp.load`` from the disk (what a resume does: the check reads the files from the disk,
DCP then finds them in the page cache); and XXH3 (the checksums' hash), CRC-32 and
SHA-256 of 256 MB in memory on one thread (what the CPU gives at that moment). Prints
the medians (one JSON line each) and the checksums' cost per round as a share of the
save and of the load (median, and the range over the rounds). Results and how to read
them: ``benchmarks/README.md``, *Checksums*.
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
import xxhash

from usp.train.checkpoint_integrity import record_checksums, verify_checksums


def _timed(fn, *args, **kwargs):
    """``(seconds, fn(*args, **kwargs))``."""
    started = time.perf_counter()
    value = fn(*args, **kwargs)
    return time.perf_counter() - started, value


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
    """Run the measurements; returns the median seconds of each (also printed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=512.0, help="checkpoint size, MB")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    args = parser.parse_args(argv)
    # one process on purpose: DCP's note that it assumes so is noise here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="usp-checksum-cost-"))
    threads_before = torch.get_num_threads()
    try:
        numel = 4 << 20  # 16 MiB of float32 per tensor
        count = max(1, round(args.mb * 1e6 / (numel * 4)))
        gen = torch.Generator().manual_seed(0)
        state = {f"w{i}": torch.randn(numel, generator=gen) for i in range(count)}
        mb = round(count * numel * 4 / 1e6, 1)
        path = root / "step"
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        blob = memoryview(os.urandom(min(int(mb * 1e6), 256 << 20)))
        times: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}  # per round: the checksums' share

        def note(what: str, seconds: float) -> float:
            times.setdefault(what, []).append(seconds)
            return seconds

        def verify_then_load(recorded):
            verify_checksums(path, recorded)
            dcp.load(target, checkpoint_id=str(path), no_dist=True)

        for _ in range(args.repeats):
            shutil.rmtree(path, ignore_errors=True)
            seconds, metadata = _timed(dcp.save, state, checkpoint_id=str(path), no_dist=True)
            save = note("dcp.save", seconds)
            for t in args.threads:
                torch.set_num_threads(t)
                seconds, (recorded, _) = _timed(record_checksums, path, metadata)
                ratios.setdefault(f"record x{t} / save", []).append(
                    note(f"record_checksums x{t}", seconds) / save
                )
            _evict(path)
            seconds, _ = _timed(dcp.load, target, checkpoint_id=str(path), no_dist=True)
            cold = note("dcp.load from disk", seconds)
            for t in args.threads:
                torch.set_num_threads(t)
                _evict(path)
                seconds, _ = _timed(verify_then_load, recorded)
                ratios.setdefault(f"verify x{t} + load / load - 1", []).append(
                    note(f"verify_checksums x{t} + dcp.load from disk", seconds) / cold - 1
                )
            for name, fn in (
                ("xxh3_64", xxhash.xxh3_64_digest),  # the checksums' (per 16 MiB chunk)
                ("crc32", zlib.crc32),
                ("sha256", hashlib.sha256),
            ):
                note(f"{name} of 256 MB in memory, one thread", _timed(fn, blob)[0])
        assert all(torch.equal(target[k], state[k]) for k in state)
        medians = {what: statistics.median(values) for what, values in times.items()}
        for what, seconds in medians.items():
            size = len(blob) / 1e6 if "in memory" in what else mb
            row = {"what": what, "mb": round(size, 1), "seconds": round(seconds, 3)}
            print(json.dumps({**row, "mb_per_s": round(size / seconds)}))
        shares = [
            f"{what}: {100 * statistics.median(v):.0f}% ({100 * min(v):.0f}..{100 * max(v):.0f}%)"
            for what, v in ratios.items()
        ]
        print(f"{mb:.0f} MB, median (range) over {args.repeats} rounds: " + "; ".join(shares))
        return medians
    finally:
        torch.set_num_threads(threads_before)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

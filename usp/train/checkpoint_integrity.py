"""A checkpoint's files, checksummed at save and verified at load; DCP's own log kept off
the console.

- :func:`record_checksums` (a collective, after ``dcp.save``): every rank hashes its
  share of the checkpoint's files (:func:`share`: the shards it wrote itself, still in
  its page cache; rank 0 also ``.metadata``) with :func:`usp.train.checksums.
  checksum_files`; rank 0 gets every file's size and checksum for ``usp_meta.json``.
- :func:`verify_checksums` (a collective, before ``dcp.load``): every rank checks its
  share against those records, and the ranks agree, so a damaged file is the same
  :class:`CheckpointDamagedError` on every rank, naming the file, before any of them
  starts loading.
- :class:`DcpLog`: while DCP runs, the records it logs to the root logger (warnings
  with tracebacks: one missing ``.metadata`` printed 8 of them, ~170 lines) go to
  ``OUTPUT/checkpoints/dcp.log`` instead of the console.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp_package

from usp.comm.agreement import agree
from usp.errors import CheckpointError
from usp.train.checksums import ALGORITHM, checksum_files, find_damage

METADATA_FILE = ".metadata"  # DCP's (written by rank 0)
_WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")  # FileSystemWriter's per-rank shard files
# where DCP's modules live, as their records name them (symlinks resolved or not)
_DCP_DIRS = tuple(
    {
        os.path.dirname(where(dcp_package.__file__)) + os.sep
        for where in (os.path.abspath, os.path.realpath)
    }
)


class CheckpointDamagedError(CheckpointError):
    """A checkpoint's file differs from what was written (raised alike on every rank)."""


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def written_files(metadata) -> list[str]:
    """The files of a checkpoint as DCP's metadata names them (every rank's shards) plus
    ``.metadata``."""
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(names) + [METADATA_FILE]


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files ``rank`` of ``world`` hashes: the shards rank ``r`` wrote go to
    ``r % world``, ``.metadata`` to rank 0, anything else round-robin."""
    mine = []
    for index, name in enumerate(sorted(names)):
        match = _WRITER.match(name)
        owner = 0 if name == METADATA_FILE else int(match.group(1)) if match else index
        if owner % world == rank:
            mine.append(name)
    return mine


def _threads() -> int:
    return max(1, torch.get_num_threads())  # the rank's share of the cores (usp train sets it)


def record_checksums(directory: Path, metadata) -> tuple[dict | None, float]:
    """Every rank's share of ``directory``'s files hashed (a collective); returns
    ``({"algorithm", "files": {name: {"bytes", "sha256"}}}, seconds)`` on rank 0 (None
    elsewhere), the seconds being the slowest rank's. A rank that cannot read its files
    is the same CheckpointError on every rank."""
    rank, world = _world()
    started = time.perf_counter()
    mine = share(written_files(metadata), rank, world)
    try:
        sums = checksum_files([directory / n for n in mine], threads=_threads())
        report = {"files": dict(zip(mine, sums)), "error": None}
    except OSError as err:
        report = {"files": {}, "error": f"rank {rank}: {err}"}
    report["seconds"] = time.perf_counter() - started
    reports = [report]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, report)
    errors = [r["error"] for r in reports if r["error"]]
    if errors:
        raise CheckpointError(
            f"hashing the files of the checkpoint {directory} after saving failed ({errors[0]})"
        )
    seconds = max(r["seconds"] for r in reports)
    if rank != 0:
        return None, seconds
    files = {name: s for r in reports for name, s in r["files"].items()}
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, seconds


def verify_checksums(directory: Path, recorded: dict | None) -> None:
    """Check this rank's share of ``directory``'s files against ``recorded`` (what
    :func:`record_checksums` gave; None: an older checkpoint without checksums, nothing
    checked); the ranks agree (a collective), so a damaged file is the same
    :class:`CheckpointDamagedError` on every rank."""
    rank, world = _world()
    damage = None
    if recorded is not None:
        if not isinstance(recorded, dict) or recorded.get("algorithm") != ALGORITHM:
            damage = "its usp_meta.json records checksums of an unknown kind"
        else:
            files = recorded.get("files", {})
            mine = {n: files[n] for n in share(list(files), rank, world)}
            damage = find_damage(directory, mine, threads=_threads())
    what = f"checking the files of {Path(directory).name} against their checksums"
    error = None if damage is None else CheckpointDamagedError(damage)
    if world == 1:
        if error is not None:
            raise CheckpointDamagedError(f"{what}: {damage}")
        return
    agree(dist.group.WORLD, what, [], error, (CheckpointDamagedError,))


class DcpLog:
    """While the ``with`` block runs, records that DCP's modules log through the root
    logger are appended to ``path`` (prefixed with the rank) instead of reaching the
    console; :attr:`records` counts them. Other loggers' records are untouched."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records = 0
        self._formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if not os.path.abspath(record.pathname).startswith(_DCP_DIRS):
            return True
        self.records += 1
        text = self._formatter.format(record)  # with the record's traceback
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"[rank {_world()[0]}] {text}\n")
        except OSError:
            pass  # the log is a convenience; the console stays clean either way
        return False

    def __enter__(self) -> DcpLog:
        logging.getLogger().addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeFilter(self)

"""Hashing files: the one SHA-256 of a file, and the checksums of what usp writes to trust
later (the tokenised-data cache, checkpoint shards).

- :func:`file_sha256`: the plain SHA-256 of a file's bytes (the data files in the
  tokenised-data cache key and in a checkpoint's run record).
- :func:`file_checksum` / :func:`checksum_files` / :func:`find_damage`: a file's size and
  the SHA-256 of the SHA-256s of its 16 MiB chunks (:data:`ALGORITHM`). The chunks
  are independent, so several threads hash one large file at once (``hashlib`` and
  ``os.pread`` release the GIL): a checkpoint shard is verified at the speed of the
  rank's cores, not of one. The digest does not depend on the thread count.

Measured on this project's 2-core CI machine (``python -m benchmarks.checksum_cost``):
SHA-256 hashes about 1.6 GB/s per core from the page cache (SHA extensions).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK_BYTES = 16 << 20
ALGORITHM = "sha256 of the sha256 of each 16 MiB chunk"
_READ_BYTES = 4 << 20


def file_sha256(path: Path) -> str:
    """The SHA-256 (hex) of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _chunk_digest(fd: int, offset: int, size: int) -> bytes:
    digest = hashlib.sha256()
    end = offset + size
    while offset < end:
        block = os.pread(fd, min(_READ_BYTES, end - offset), offset)
        if not block:
            raise OSError(f"the file ended at byte {offset} while being read")
        digest.update(block)
        offset += len(block)
    return digest.digest()


def _pool_map(fn, items: list, threads: int) -> list:
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def checksum_files(paths: Iterable[Path], *, threads: int = 1) -> list[dict]:
    """``{"bytes": size, "sha256": digest}`` of each file (see :data:`ALGORITHM`), their
    chunks hashed by up to ``threads`` threads together. Raises OSError."""
    paths = [Path(p) for p in paths]
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        work = [
            (index, offset, min(CHUNK_BYTES, size - offset))
            for index, size in enumerate(sizes)
            for offset in range(0, size, CHUNK_BYTES)
        ]
        digests = _pool_map(lambda w: _chunk_digest(fds[w[0]], w[1], w[2]), work, threads)
    finally:
        for fd in fds:
            os.close(fd)
    per_file: list[list[bytes]] = [[] for _ in paths]
    for (index, _, _), digest in zip(work, digests):  # in order: chunk order per file
        per_file[index].append(digest)
    return [
        {"bytes": size, "sha256": hashlib.sha256(b"".join(chunks)).hexdigest()}
        for size, chunks in zip(sizes, per_file)
    ]


def file_checksum(path: Path, *, threads: int = 1) -> dict:
    """One file's ``{"bytes", "sha256"}`` (see :func:`checksum_files`)."""
    return checksum_files([path], threads=threads)[0]


def find_damage(directory: Path, recorded: dict[str, dict], *, threads: int = 1) -> str | None:
    """Compare the files named in ``recorded`` (``name -> {"bytes", "sha256"}``) under
    ``directory`` with their records; returns what is wrong with the first file that
    differs (missing, another size, other bytes), or None when all match."""
    names = sorted(recorded)
    for name in names:  # the cheap checks first: a missing or cut file needs no hashing
        path = Path(directory) / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != recorded[name]["bytes"]:
            return f"{name} has {size} bytes, {recorded[name]['bytes']} when it was written"
    try:
        found = checksum_files([Path(directory) / n for n in names], threads=threads)
    except OSError as err:
        return f"reading it failed ({err})"
    for name, checksum in zip(names, found):
        if checksum["sha256"] != recorded[name]["sha256"]:
            return (
                f"{name} does not match the checksum recorded when it was written (its bytes "
                "changed since)"
            )
    return None

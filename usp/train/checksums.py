"""Hashing files: the one SHA-256 of a file, and the checksums of what usp writes to trust
later (the tokenised-data cache, checkpoint shards).

- :func:`file_sha256`: the plain SHA-256 of a file's bytes: the identity of the data
  files (in the tokenised-data cache key and in a checkpoint's run record).
- :func:`checksum_files` / :func:`file_checksum` / :func:`find_damage`: a file's size
  and a checksum that detects damage (:data:`ALGORITHM`): the 64-bit XXH3 of every
  16 MiB chunk, the chunks' digests then hashed together with SHA-256. XXH3 is a
  non-cryptographic hash (random damage goes unnoticed with probability 2^-64 per
  chunk) at about 13 GB/s per thread here, against about 4 GB/s for CRC-32 and 1.8 GB/s
  for SHA-256 (``benchmarks/checksum_cost.py``, ``benchmarks/README.md``): the files it
  guards are ones usp wrote itself, and tampering is out of scope (a checkpoint must
  come from a trusted source anyway). The chunks are independent, so several threads
  check one large file at once (``xxhash`` and ``os.preadv`` release the GIL); the
  checksum does not depend on the thread count.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

CHUNK_BYTES = 16 << 20
ALGORITHM = "xxh3_64 of each 16 MiB chunk, the chunks' digests sha256-hashed"
_READ_BYTES = 4 << 20


def file_sha256(path: Path) -> str:
    """The SHA-256 (hex) of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _chunk_digest(fd: int, offset: int, size: int) -> bytes:
    digest = xxhash.xxh3_64()
    buffer = bytearray(min(_READ_BYTES, size))  # reused: no allocation per read
    view = memoryview(buffer)
    end = offset + size
    while offset < end:
        got = os.preadv(fd, [view[: min(len(buffer), end - offset)]], offset)
        if not got:
            raise OSError(f"the file ended at byte {offset} while being read")
        digest.update(view[:got])
        offset += got
    return digest.digest()


def _pool_map(fn, items: list, threads: int) -> list:
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def checksum_files(paths: Iterable[Path], *, threads: int = 1) -> list[dict]:
    """``{"bytes": size, "xxh3": checksum}`` of each file (see :data:`ALGORITHM`), their
    chunks read and checked by up to ``threads`` threads together. Raises OSError."""
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
        {"bytes": size, "xxh3": hashlib.sha256(b"".join(chunks)).hexdigest()}
        for size, chunks in zip(sizes, per_file)
    ]


def file_checksum(path: Path, *, threads: int = 1) -> dict:
    """One file's ``{"bytes", "xxh3"}`` (see :func:`checksum_files`)."""
    return checksum_files([path], threads=threads)[0]


def find_damage(directory: Path, recorded: dict[str, dict], *, threads: int = 1) -> str | None:
    """Compare the files named in ``recorded`` (``name -> {"bytes", "xxh3"}``) under
    ``directory`` with their records; returns what is wrong with the first file that
    differs (missing, another size, other bytes), or None when all match."""
    names = sorted(recorded)
    for name in names:  # the cheap checks first: a missing or cut file needs no reading
        path = Path(directory) / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != recorded[name]["bytes"]:
            return f"{name} has {size} bytes, {recorded[name]['bytes']} when it was written"
    try:
        found = checksum_files([Path(directory) / n for n in names], threads=threads)
    except OSError as err:
        return f"reading the files failed ({err})"
    for name, checksum in zip(names, found):
        if checksum["xxh3"] != recorded[name].get("xxh3"):
            return (
                f"{name} does not match the checksum recorded when it was written (its bytes "
                "changed since)"
            )
    return None

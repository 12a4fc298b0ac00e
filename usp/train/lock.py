"""One job per output directory: ``OUTPUT/.usp.lock``.

Rank 0 takes the lock before anything is written to ``OUTPUT`` and holds it until the
job ends. The lock is an exclusive ``flock`` on the file, which the kernel releases when
the holding process dies however it dies (``kill -9`` included), plus the holder's host,
pid and start time written in the file so a refused job can name it:

- the flock is held: another job is running here -> :class:`OutputLockedError`;
- the flock is free, the file names a process on this host: that process is gone (or
  no longer holds it), the lock is stale and taken over with a note;
- the flock is free, the file names another host: that job may still be running there
  (a shared file system need not carry locks between hosts) -> refused, and the message
  says how to clear the lock when that job is gone.

An empty lock file is a released lock (releasing truncates the file and unlocks it; the
file stays, so two jobs racing for it always lock the same file).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from usp.errors import ConfigError

LOCK_FILE = ".usp.lock"


class OutputLockedError(ConfigError):
    """Another job holds (or may hold) the output directory."""


@dataclass
class OutputLock:
    """A held lock on ``path`` (release it with :meth:`release`). ``note`` says whether a
    stale lock was taken over."""

    path: Path
    fd: int
    note: str | None = None

    @classmethod
    def acquire(cls, directory: Path) -> OutputLock:
        """Lock ``directory`` (created if missing) for this process, or raise
        :class:`OutputLockedError` naming the holder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise OutputLockedError(
                f"{directory} is in use by another usp train job ({_describe(holder)}): one "
                "job per output directory. Wait for it to end, stop it, or choose another "
                "--output directory"
            ) from None
        holder = _read(fd)
        note = None
        if holder:
            if holder.get("host") != socket.gethostname():
                os.close(fd)  # closing releases the flock
                raise OutputLockedError(
                    f"{directory} is locked by a usp train job on another host "
                    f"({_describe(holder)}); it may still be running there. If it is not, "
                    f"delete {path} and start again; or choose another --output directory"
                )
            note = f"took over the stale lock of a job that is gone ({_describe(holder)})"
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(path, fd, note)

    def release(self) -> None:
        """Empty the file and unlock it (idempotent)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):  # unlocking is what matters
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # releases the flock
        self.fd = -1


def _read(fd: int) -> dict | None:
    """The holder's record, ``{}`` for an unreadable one, ``None`` for an empty file."""
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder unknown: the lock file names no process"
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
        f"{holder.get('started', '?')}"
    )


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())


# What usp train writes in OUTPUT: name -> (a file or a directory, what it is)
OUTPUT_PATHS = {
    LOCK_FILE: ("file", "its lock"),
    "metrics.jsonl": ("file", "its metrics"),
    "loss.png": ("file", "the loss plot"),
    "checkpoints": ("directory", "its checkpoints"),
    "cache": ("directory", "the tokenised data"),
    "hf": ("directory", "the HF export"),
}


def check_output_dir(out: Path, *, export: bool = True) -> None:
    """The output directory can be created and written, and every path usp train writes
    there (:data:`OUTPUT_PATHS`; ``hf`` only with ``export``) is absent or of the kind it
    writes (a start-up check: a ``metrics.jsonl`` that is a directory would fail rank 0
    only, after the model was built)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise ConfigError(
            f"the output directory {out} is not writable ({err.strerror or err}); choose "
            "another with --output or [train] output_dir"
        ) from None
    for name, (kind, what) in OUTPUT_PATHS.items():
        path = out / name
        if (name == "hf" and not export) or not os.path.lexists(path):
            continue
        found = "directory" if path.is_dir() else "file" if path.is_file() else "other"
        if found != kind:
            shown = {"directory": "a directory", "file": "a file"}.get(
                found, "neither a file nor a directory"
            )
            raise ConfigError(
                f"{path} is {shown}, but usp train writes {what} there (a {kind}): move it "
                "away, or choose another --output directory"
            )
        if not os.access(path, os.W_OK | (os.X_OK if kind == "directory" else 0)):
            raise ConfigError(
                f"{path} is not writable, and usp train writes {what} there: fix its "
                "permissions, or choose another --output directory"
            )

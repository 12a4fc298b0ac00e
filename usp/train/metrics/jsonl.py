"""``metrics.jsonl``: one JSON object per optimizer step (and per ``[eval]`` evaluation,
told apart by its ``eval_loss``), written by rank 0 so that a crash leaves whole lines,
and read back tolerantly (a resume, the loss chart, tests)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per step to ``path`` (rank 0 only).

    Each row is one line written with a single ``write`` on an ``O_APPEND`` descriptor
    and flushed to the OS, so a crash leaves whole lines (at most the line in flight is
    cut). Non-finite numbers are written as ``null`` (JSON has no NaN; see
    :func:`finite_or_none`). A resumed run keeps the rows up to ``resume_after_step`` and
    drops the steps it will redo; lines that cannot be parsed (a row cut by a crash) are
    dropped too, each with a note in :attr:`notes`.
    """

    def __init__(self, path: Path, *, resume_after_step: int | None = None):
        self.path = path
        self.notes: list[str] = []
        kept: list[dict[str, Any]] = []
        if resume_after_step is not None and path.exists():
            rows, self.notes = read_metrics_tolerant(path)
            kept = [r for r in rows if _step_of(r) <= resume_after_step]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        self._fd = os.open(path, flags, 0o644)
        if kept:
            os.write(self._fd, "".join(_line(r) for r in kept).encode("utf-8"))

    def write(self, row: dict[str, Any]) -> None:
        os.write(self._fd, _line(row).encode("utf-8"))  # one write per row

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def finite_or_none(value: Any) -> Any:
    """A float that is NaN or infinite becomes ``None`` (``null`` in the file)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _line(row: dict[str, Any]) -> str:
    clean = {k: finite_or_none(v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def _step_of(row: dict[str, Any]) -> int:
    step = row.get("step", 0)
    return step if isinstance(step, int) else 0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (lines that do not parse are skipped)."""
    return read_metrics_tolerant(path)[0]


def read_metrics_tolerant(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``(rows, notes)``: every line that parses as a JSON object, and one note per line
    that does not (a row cut by a crash, a stray write), naming the line."""
    rows, notes = [], []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            last = number == len(lines) or all(not r.strip() for r in lines[number:])
            what = "the last line" if last else f"line {number}"
            notes.append(
                f"{path}: dropped {what}, which is not a JSON object (a row cut off by a "
                f"crash?): {raw[:80].decode('utf-8', 'replace')!r}"
            )
    return rows, notes

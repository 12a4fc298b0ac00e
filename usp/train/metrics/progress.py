"""Rank 0's progress display: a tqdm bar on a terminal (rich when tqdm is absent), else
printed lines. tqdm and rich are optional and imported lazily."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _number(value: Any, spec: str) -> str:
    return "nan" if value is None else format(value, spec)  # null in a row: non-finite


def summary(row: dict[str, Any], evaluation: dict[str, Any] | None = None) -> str:
    """The short form of one step's metrics shown by the progress display, with the
    latest ``evaluation`` row's loss."""
    parts = [f"loss {row['loss']:.4f}", f"grad_norm {row['grad_norm']:.3g}"]
    if "aux_loss" in row:
        parts.insert(1, f"aux_loss {_number(row['aux_loss'], '.4f')}")
    if row.get("skipped"):
        parts.append("SKIPPED (non-finite: the update was not applied)")
    parts.append(f"lr {row['lr']:.2e}")
    parts.append(f"tok/s/gpu {row['tokens_per_s_per_gpu']:,.0f}")
    if "mfu" in row:
        parts.append(f"mfu {100 * row['mfu']:.1f}%")
    if "peak_memory_gib" in row:
        parts.append(f"mem {row['peak_memory_gib']:.1f}GiB")
    if evaluation is not None:
        parts.append(f"eval_loss {_number(evaluation['eval_loss'], '.4f')}@{evaluation['step']}")
    return "  ".join(parts)


def eval_summary(row: dict[str, Any]) -> str:
    """The line an ``[eval]`` evaluation prints."""
    return (
        f"eval after step {row['step']}: eval_loss {_number(row['eval_loss'], '.4f')} "
        f"(perplexity {_number(row['eval_perplexity'], '.4g')}) over {row['eval_tokens']:,} "
        f"label tokens in {row['eval_sequences']} sequences, {row['eval_time_s']:.1f} s"
    )


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal (rich when tqdm is absent), else one
    printed line every ``log_interval`` steps (and at the last step)."""

    def __init__(self, total: int, start: int, *, log_interval: int, stream: TextIO | None = None):
        self.total, self.log_interval = total, log_interval
        self.stream = stream or sys.stderr
        self._start_time, self._start_step = time.perf_counter(), start
        self._bar = None
        self._rich = None
        self._evaluation: dict[str, Any] | None = None  # the latest [eval] row
        if self.stream.isatty():
            self._bar = _tqdm_bar(total, start, self.stream)
            if self._bar is None:
                self._rich = _rich_progress(total, start, self.stream)

    def eta(self, step: int) -> float:
        done = step - self._start_step
        if done <= 0:
            return math.inf
        per_step = (time.perf_counter() - self._start_time) / done
        return per_step * (self.total - step)

    def update(self, row: dict[str, Any]) -> None:
        step = row["step"]
        line = summary(row, self._evaluation)
        if self._bar is not None:
            self._bar.set_postfix_str(line, refresh=False)
            self._bar.update(1)
        elif self._rich is not None:
            progress, task = self._rich
            progress.update(task, advance=1, description=line)
        elif step % self.log_interval == 0 or step == self.total:
            print(
                f"step {step}/{self.total}  {line}  eta {_duration(self.eta(step))}",
                file=self.stream,
                flush=True,
            )

    def evaluation(self, row: dict[str, Any]) -> None:
        """An ``[eval]`` row: one line now; its loss joins the later progress lines."""
        self._evaluation = row
        line = eval_summary(row)
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        elif self._rich is not None:
            self._rich[0].console.print(line, highlight=False, markup=False)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._rich is not None:
            self._rich[0].stop()


def _tqdm_bar(total: int, start: int, stream: TextIO):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, file=stream, dynamic_ncols=True, unit="step")


def _rich_progress(total: int, start: int, stream: TextIO):
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return None
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=Console(file=stream),
    )
    task = progress.add_task("", total=total, completed=start)
    progress.start()
    return progress, task

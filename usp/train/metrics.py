"""What a run shows while it runs and leaves behind: a progress display on rank 0,
``metrics.jsonl`` (one JSON object per optimizer step, and one per ``[eval]`` evaluation,
told apart by its ``eval_loss``) and ``loss.png``.

tqdm, rich and matplotlib are optional and imported lazily: without them the progress is
printed as plain lines and the plot is drawn by :mod:`usp.train.png_chart` (standard
library only), so every run leaves a ``loss.png``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from usp.models import levers_of, lora_of
from usp.train.png_chart import write_line_chart

# Dense bf16 tensor-core peak per device, for the MFU estimate (vendor figures, TFLOP/s).
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known accelerator, else None (no MFU shown)."""
    for key, value in _PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


# ----------------------------------------------------------------------------- jsonl
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


# ----------------------------------------------------------------------------- progress
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


# ----------------------------------------------------------------------------- plot
def plot_loss(metrics_path: Path, png_path: Path) -> str | None:
    """Write the loss curve, with the ``[eval]`` losses as points on a second line
    (matplotlib when installed, else the built-in PNG chart); returns None on success,
    else why it was not written."""
    rows = read_metrics(metrics_path) if metrics_path.exists() else []
    if not rows:
        return "no steps were logged"
    evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    rows = [r for r in rows if isinstance(r.get("loss"), (int, float))]  # null: non-finite
    if not rows:
        return "no finite loss was logged"
    steps, losses = [r["step"] for r in rows], [r["loss"] for r in rows]
    eval_points = ([r["step"] for r in evals], [r["eval_loss"] for r in evals])
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        write_line_chart(png_path, steps, losses, points=eval_points if evals else None)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, linewidth=1.2, label="training loss")
    if evals:
        ax.plot(*eval_points, "o-", markersize=4, linewidth=1.0, label="eval loss ([eval])")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over label tokens)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------- rows
GIB = 2**30


def device_peak_tflops(job, device) -> float | None:
    if job.train.peak_tflops != "auto":
        return float(job.train.peak_tflops)
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class StepTiming:
    """One finished optimizer step as the log shows it."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    #: the router's load-balancing loss (before its coefficient), the mean over the
    #: step's forwards; None: the model adds none
    aux_loss: float | None = None


def step_row(timing: StepTiming, batch, job, counts, world, device, peak) -> dict:
    """The ``metrics.jsonl`` row of a step. ``counts``: the model's
    :class:`usp.models.ModelCounts` (for MFU); ``peak``: the device's TFLOP/s or None."""
    tokens = job.train.global_batch * job.train.seq_len
    seconds = timing.seconds
    row = {
        "step": timing.step,
        "loss": timing.loss,
        "grad_norm": timing.grad_norm,
        "lr": timing.lr,
        "tokens": tokens,
        "label_tokens": batch.num_labels,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "step_time_s": seconds,
    }
    if timing.aux_loss is not None:  # (loss includes router_aux_loss_coef x each forward's)
        row["aux_loss"] = timing.aux_loss
    if peak is not None:
        flops = counts.training_flops(batch.document_lengths)
        row["mfu"] = flops / seconds / world / (peak * 1e12)
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    else:  # the process's peak resident memory: its tensors plus Python and the libraries
        # (not a tensor count like CUDA's: above `usp plan`'s figure)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
        row["peak_memory_gib"] = peak * (1 if sys.platform == "darwin" else 1024) / GIB
    return row


def _lora_lines(model) -> list[str]:
    """``[train] lora``: its settings and the trainable share of the parameters."""
    lora = lora_of(model)
    if lora is None:
        return []
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return [
        f"  lora:  {lora.describe()}; {trained / 1e6:.3f}M trainable parameters "
        f"({100 * trained / total:.2f}%), the base frozen"
    ]


def print_header(job, plan, source, dataset, model, state, newest, stream) -> None:
    params = sum(p.numel() for p in model.parameters())
    t = job.train
    dp = plan.topology.dp_degree
    accumulation = job.gradient_accumulation(dp)
    what = source.directory or f'preset "{job.model.preset}"'
    config = source.config
    lines = [
        f"usp train: {job.source or 'config'}",
        f"  plan:  {plan.describe()}",
        f"  model: {what} ({config.family}), {params / 1e6:.2f}M parameters, "
        f"{config.num_hidden_layers} layers",
        f"  levers: {levers_of(model).describe()}",
        *_lora_lines(model),
        *(f"  data:  {line}" for line in dataset.summary(t.steps * t.global_batch)),
        f"  batch: {t.global_batch} sequences/step = dp {dp} x micro_batch {t.micro_batch} x "
        f"accumulation {accumulation}",
    ]
    lines += [f"  rope:  {change} ([model] setting)" for change in source.changes]
    if newest is not None:
        lines.append(f"  resuming from {newest} (step {state.step})")
    print("\n".join(lines), file=stream, flush=True)

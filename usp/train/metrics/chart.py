"""``loss.png``: the training loss curve (and the ``[eval]`` losses) from
``metrics.jsonl``. matplotlib is optional and imported lazily: without it the chart is
drawn by :mod:`usp.train.png_chart` (standard library only), so every run leaves one."""

from __future__ import annotations

from pathlib import Path

from usp.train.metrics.jsonl import read_metrics
from usp.train.png_chart import write_line_chart


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

"""What ``usp eval`` leaves behind: ``eval.json``, a table on stdout (or the JSON with
``--json``), and with matplotlib installed ``perplexity.png`` (perplexity against
position, one line per length) and, with ``--passkey``, ``passkey.png`` (the accuracy
heatmap over length and depth). matplotlib is imported lazily; without it the PNGs are
skipped and the report says why."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MATPLOTLIB_MISSING = "matplotlib is not installed (pip install matplotlib, or usp[plot])"


def to_json(report: dict[str, Any]) -> str:
    """The report as JSON; non-finite numbers become ``null``."""
    return json.dumps(_finite(report), indent=2, allow_nan=False) + "\n"


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def table(report: dict[str, Any]) -> str:
    """The human-readable form: perplexity per position bucket, passkey per depth."""
    lines = [f"usp eval: {report['target']}", f"  plan:  {report['plan']}"]
    lines += [f"  data:  {report['data']}"]
    for length in report["lengths"]:
        ppl = report["perplexity"][str(length)]
        cells = "  ".join(
            f"{start}:{_show(value)}" for start, value in zip(ppl["bucket_starts"], ppl["values"])
        )
        lines.append(
            f"  length {length}: perplexity {_show(ppl['overall'])} over {sum(ppl['tokens'])} "
            f"tokens in {ppl['windows']} windows; by position  {cells}"
        )
        if "passkey" in report:
            accuracy = report["passkey"][str(length)]
            cells = "  ".join(f"{depth}:{value:.2f}" for depth, value in accuracy.items())
            lines.append(f"  length {length}: passkey accuracy by depth  {cells}")
    lines += [f"  note: {note}" for note in report.get("notes", [])]
    for name, value in report.get("files", {}).items():
        lines.append(f"  {name}: {value}")
    return "\n".join(lines)


def _show(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def write_plots(report: dict[str, Any], directory: Path) -> dict[str, str]:
    """``{name: path or "skipped: why"}`` for perplexity.png and (with passkey results)
    passkey.png, written into ``directory``."""
    names = ["perplexity.png"] + (["passkey.png"] if "passkey" in report else [])
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return {name: f"skipped: {MATPLOTLIB_MISSING}" for name in names}
    written = {"perplexity.png": str(_perplexity_plot(plt, report, directory))}
    if "passkey" in report:
        written["passkey.png"] = str(_passkey_heatmap(plt, report, directory))
    return written


def _perplexity_plot(plt, report, directory: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for length in report["lengths"]:
        ppl = report["perplexity"][str(length)]
        points = [(s, v) for s, v in zip(ppl["bucket_starts"], ppl["values"]) if v is not None]
        ax.plot(*zip(*points), "o-", markersize=3, label=f"length {length}")
    ax.set_xlabel("position (start of the bucket)")
    ax.set_ylabel("perplexity")
    ax.set_title(report["target"])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = directory / "perplexity.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _passkey_heatmap(plt, report, directory: Path) -> Path:
    lengths = report["lengths"]
    depths = list(report["passkey"][str(lengths[0])])
    grid = [[report["passkey"][str(n)][d] for n in lengths] for d in depths]  # [depth, length]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3, 0.5 * len(depths) + 2))
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), depths)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("depth of the pass key")
    for row, values in enumerate(grid):
        for col, value in enumerate(values):
            ax.text(col, row, f"{value:.2f}", ha="center", va="center")
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(f"passkey retrieval, {report['passkey_trials']} trials per cell")
    fig.tight_layout()
    path = directory / "passkey.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

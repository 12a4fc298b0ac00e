"""What a run shows while it runs and leaves behind, one module per job:

* :mod:`~usp.train.metrics.jsonl`: ``metrics.jsonl`` (one JSON object per optimizer step
  and per ``[eval]`` evaluation), written on rank 0 and read back;
* :mod:`~usp.train.metrics.step_row`: a step's row (throughput, memory, MFU);
* :mod:`~usp.train.metrics.mfu`: the device's peak TFLOP/s for the MFU estimate;
* :mod:`~usp.train.metrics.progress`: the progress display (tqdm, rich or plain lines);
* :mod:`~usp.train.metrics.chart`: ``loss.png`` (matplotlib or :mod:`usp.train.png_chart`);
* :mod:`~usp.train.metrics.header`: the lines printed when a run starts.

tqdm, rich and matplotlib are optional and imported lazily. The names below are
re-exported so that ``from usp.train.metrics import ...`` reaches each of them.
"""

from usp.train.metrics.chart import plot_loss
from usp.train.metrics.header import print_header
from usp.train.metrics.jsonl import (
    MetricsWriter,
    finite_or_none,
    read_metrics,
    read_metrics_tolerant,
)
from usp.train.metrics.mfu import device_peak_tflops, peak_tflops
from usp.train.metrics.progress import Progress, eval_summary, summary
from usp.train.metrics.step_row import GIB, StepTiming, step_row

__all__ = [
    "GIB",
    "MetricsWriter",
    "Progress",
    "StepTiming",
    "device_peak_tflops",
    "eval_summary",
    "finite_or_none",
    "peak_tflops",
    "plot_loss",
    "print_header",
    "read_metrics",
    "read_metrics_tolerant",
    "step_row",
    "summary",
]

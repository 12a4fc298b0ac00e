"""``[train] report_to``: every metrics row also to TensorBoard and/or Weights & Biases.

Rows are taken generically, as :class:`usp.train.metrics.jsonl.MetricsWriter` gets them (step
rows, evaluation rows, whatever a later feature adds): each number of a row becomes a
scalar at the row's ``step``, named ``eval/<rest>`` for a key ``eval_<rest>`` and
``train/<key>`` otherwise (``train/loss``, ``train/lr``, ``train/grad_norm``,
``train/tokens_per_s``, ..., ``eval/loss``). Rank 0 only, as ``metrics.jsonl``.

- ``"tensorboard"``: event files under ``output_dir/tensorboard/`` (torch's
  ``SummaryWriter``; the ``tensorboard`` package). A resumed run purges the events after
  the checkpoint's step, as ``metrics.jsonl`` drops its rows.
- ``"wandb"``: a run through the ``wandb`` library, its files under ``output_dir/wandb/``;
  the usual ``WANDB_*`` variables apply (``WANDB_MODE=offline`` needs no network,
  ``WANDB_PROJECT``, default ``usp``). The run id is kept in ``output_dir/wandb_run_id``
  so a resumed run continues the same W&B run.

Both libraries are optional (``pip install 'usp[tensorboard]'``, ``'usp[wandb]'``); asking
for one that is missing is a :class:`~usp.config.ConfigError` at start-up naming the extra.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from usp.comm.agreement import agree
from usp.config import ConfigError

#: report_to name -> (the module it needs, the pip extra that installs it)
LIBRARIES = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}
WANDB_PROJECT = "usp"
RUN_ID_FILE = "wandb_run_id"


def check_available(report_to) -> None:
    """Import each library ``report_to`` names; a missing one is a ConfigError naming the
    extra (called at set-up, before anything is trained)."""
    for name in report_to:
        module, extra = LIBRARIES[name]
        try:
            __import__(module)
        except ImportError as err:
            raise ConfigError(
                f'[train] report_to = ["{name}"] needs the {extra} package, which is not '
                f"installed ({err}): pip install 'usp[{extra}]' (or pip install {extra}), or "
                f"remove {name!r} from report_to"
            ) from None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers as scalar names -> values (see the module doc)."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # the x axis, flags (skipped), nulls and text
        if isinstance(value, float) and not math.isfinite(value):
            continue
        name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
        out[name] = float(value)
    return out


class TensorBoardReporter:
    def __init__(self, out: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it in earlier files are dropped (the steps redone)
        purge = start_step + 1 if start_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a row is seconds of training: show it now

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        id_file = out / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
            dir=str(out),
            name=out.resolve().name,
            id=run_id,
            resume="allow",
            config=config,
        )
        if run_id is None:
            id_file.write_text(self.run.id + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_reporters(report_to, out: Path, *, start_step: int, config: dict[str, Any]) -> list:
    """The reporters ``report_to`` names (rank 0), writing from ``start_step`` on."""
    made = []
    try:
        for name in report_to:
            if name == "tensorboard":
                made.append(TensorBoardReporter(out, start_step))
            else:
                made.append(WandbReporter(out, config))
    except BaseException:
        for reporter in made:  # those that started end with the one that did not
            reporter.close()
        raise
    return made


class ReportingWriter:
    """A :class:`~usp.train.metrics.jsonl.MetricsWriter` whose rows also go to the reporters
    (the same interface: ``write``, ``close``, ``notes``)."""

    def __init__(self, writer, reporters: list) -> None:
        self.writer, self.reporters = writer, reporters

    @property
    def notes(self) -> list[str]:
        return self.writer.notes

    def write(self, row: dict[str, Any]) -> None:
        self.writer.write(row)
        step = row.get("step")
        values = scalars(row)
        if isinstance(step, int) and values:
            for reporter in self.reporters:
                reporter.log(step, values)

    def close(self) -> None:
        self.writer.close()
        for reporter in self.reporters:
            reporter.close()

    def __getattr__(self, name: str):  # the rest of MetricsWriter's (``path``, ...)
        if name == "writer":
            raise AttributeError(name)
        return getattr(self.writer, name)


def reporting(writer, job, out: Path, *, start_step: int, distributed: bool = False):
    """``writer`` as is without ``[train] report_to``, else wrapped in a
    :class:`ReportingWriter` on rank 0 (the rank with a ``writer``; ``None`` stays
    ``None``). Every rank calls it: a reporter that does not start on rank 0 (W&B not
    logged in, say) is the same :class:`ConfigError` on every rank (one agreement),
    instead of rank 0 failing while the others wait for it in the first step."""
    if not job.train.report_to:
        return writer
    reporters, error = [], None
    if writer is not None:
        try:
            reporters = open_reporters(
                job.train.report_to, out, start_step=start_step, config=job.tables
            )
        except Exception as err:  # noqa: BLE001 - any library's failure, reported alike
            error = ConfigError(
                f"[train] report_to = {list(job.train.report_to)}: a reporter did not start "
                f"({type(err).__name__}: {err}); for W&B without a network or a login, set "
                "WANDB_MODE=offline"
            )
            writer.close()
    if distributed:
        agree(dist.group.WORLD, "starting [train] report_to", [], error, (ConfigError,))
    elif error is not None:
        raise error
    return writer if writer is None else ReportingWriter(writer, reporters)

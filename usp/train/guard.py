"""What stops a training run on purpose, and how each stop is reported.

- :class:`StopSignal`: SIGTERM/SIGINT set a flag; the loop checks it at the next step
  boundary, and the ranks agree on it (:func:`agree_on_step`), so all of them save the
  same checkpoint and leave together. A second signal (more than
  :data:`REPEAT_AFTER_S` after the first: a launcher forwarding the same Ctrl-C to its
  workers is one event) exits at once.
- :func:`agree_on_step`: one small all-gather per step over every rank, before the
  optimizer steps: is the step's loss or gradient norm non-finite anywhere, and did any
  rank get a signal. :func:`agree_on_stop` asks the last question alone, right after a
  checkpoint save: a signal that came during the save stops the run there, with that
  checkpoint, instead of after one more step (which a launcher's grace period may not
  cover).
- :class:`TrainingDivergedError`, :class:`CollectiveFailedError`: the errors of a
  diverged run and of a collective that failed (a peer stalled or died).

Exit statuses of ``usp train`` (one table, used by :mod:`usp.train.cli`): see
:data:`EXIT_STATUS`.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_uncounted
from usp.errors import RankDisagreementError, TrainingError

REPEAT_AFTER_S = 2.0

EXIT_STATUS = {
    "done": 0,
    "internal": 1,  # an unexpected error (traceback printed)
    "user": 2,  # config, data, checkpoint, output directory in use
    "diverged": 3,  # non-finite loss / gradient norm / weights
    "collective": 4,  # a collective failed or timed out (a peer stalled or died)
    "signal": 5,  # stopped by SIGTERM/SIGINT after saving a checkpoint
}


class TrainingDivergedError(TrainingError):
    """The loss, the gradient norm or the weights became non-finite."""


class CollectiveFailedError(RankDisagreementError):
    """A collective did not complete: a peer rank stalled, died or timed out."""


# ----------------------------------------------------------------------------- signals
class StopSignal:
    """SIGTERM and SIGINT handlers for the life of a ``with`` block (main thread only;
    elsewhere, e.g. in a worker thread, nothing is installed and :attr:`name` stays
    None). :attr:`name` is the first signal's name once one arrived."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.name is None:
            self.name, self._first_at = name, time.monotonic()
            return
        if time.monotonic() - self._first_at < REPEAT_AFTER_S:
            return  # the same event, forwarded by the launcher
        print(
            f"usp train [rank {os.environ.get('RANK', 0)}]: second signal ({name}): exiting "
            "now without a checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)


# ----------------------------------------------------------------------------- per step
def agree_on_step(loss: float, grad_norm: float, signal_name: str | None, device, distributed):
    """``(loss, grad_norm, non_finite, stop)`` as every rank sees them: one all-gather of
    three numbers per rank over the default group when ``distributed``. When any rank's
    loss or norm is non-finite, every rank returns that (first such) rank's values."""
    mine = [loss, grad_norm, float(signal_name is not None)]
    if not distributed:
        rows = [mine]
    else:
        local = torch.tensor([mine], dtype=torch.float64, device=device)
        every = torch.empty((dist.get_world_size(), 3), dtype=torch.float64, device=device)
        all_gather_uncounted(every, local, dist.group.WORLD)
        rows = every.tolist()
    bad = [row for row in rows if not (math.isfinite(row[0]) and math.isfinite(row[1]))]
    stop = any(row[2] for row in rows)
    if bad:
        return bad[0][0], bad[0][1], True, stop
    return loss, grad_norm, False, stop


def agree_on_stop(signal_name: str | None, device, distributed) -> bool:
    """Whether any rank got a stop signal (one all-reduce of a flag when ``distributed``)."""
    flag = torch.tensor([int(signal_name is not None)], dtype=torch.int64, device=device)
    if distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def parameters_finite(model, device, distributed) -> bool:
    """Whether every rank's parameters (their local shards) are finite (a collective
    when ``distributed``)."""
    ok = torch.ones((), dtype=torch.int64, device=device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel():
            ok &= torch.isfinite(local.detach()).all().to(torch.int64)
    if distributed:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


# ----------------------------------------------------------------------------- collectives
_COMM_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


def is_collective_failure(err: BaseException) -> bool:
    """A failed collective: torch's distributed errors, or gloo's plain RuntimeErrors."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(part in text for part in _COMM_FAILURES)


@contextmanager
def collective_phase(what: str, timeout_s: float):
    """Turn a failed collective inside the block into a :class:`CollectiveFailedError`
    that names ``what`` (the step and the phase)."""
    try:
        yield
    except Exception as err:
        if not is_collective_failure(err):
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CollectiveFailedError(
            f"{what}: a collective did not complete ({first_line}). A peer rank stalled or "
            f"died; [train] collective_timeout_s = {timeout_s:g} is how long a rank waits for "
            "its peers. --resume continues from the newest checkpoint"
        ) from err


# ----------------------------------------------------------------------------- messages
def newest_note(checkpointer, resumed_from=None) -> str:
    """Which checkpoint ``--resume`` would continue from: the newest this run saved, else
    ``resumed_from`` (the one it loaded; newer ones it fell back past do not load). When
    that is ``resumed_from``, resuming would load it again and may repeat what happened,
    so the note names the step before it instead."""
    found = checkpointer.complete()  # (step, path), oldest first
    saved = {Path(s.path) for s in checkpointer.saves}
    ours = [path for _, path in found if Path(path) in saved]
    if ours:
        return f"The newest checkpoint is {ours[-1].name} (--resume continues from it)"
    steps = {Path(path): step for step, path in found}
    if resumed_from is None or Path(resumed_from) not in steps:
        if not found:
            return "No checkpoint was written yet"
        return f"The newest checkpoint is {found[-1][1].name} (--resume continues from it)"
    resumed_from = Path(resumed_from)
    again = (
        f"This run started from {resumed_from.name} and saved no checkpoint since: --resume "
        "would load it again and may repeat this"
    )
    earlier = [(step, path) for step, path in found if step < steps[resumed_from]]
    if not earlier:
        return f"{again}; there is no earlier checkpoint: start again in another --output directory"
    step, path = earlier[-1]
    return (
        f"{again}. To resume from step {step} ({path.name}) instead, move {resumed_from} out "
        f"of the way (e.g. mv {resumed_from} {resumed_from}.diverged), then --resume"
    )


def diverged_message(job, step, loss, grad_norm, skipped, checkpointer, resumed_from=None) -> str:
    allowed = job.train.max_skipped_steps
    return (
        f"step {step}: the loss is {loss:.4g} and the gradient norm {grad_norm:.4g}; the "
        f"update was not applied. {len(skipped)} non-finite step(s) (steps {skipped}) exceed "
        f"[train] max_skipped_steps = {allowed}, so the run stopped. "
        f"{newest_note(checkpointer, resumed_from)}. Lower [train] lr (now {job.train.lr:g}), "
        "check the data, or raise max_skipped_steps to skip rare bad batches"
    )

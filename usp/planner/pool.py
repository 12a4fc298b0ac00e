"""The plan's measurements, in this process or in worker processes (``usp plan --jobs``).

A plan measures many independent steps: one per layout, sequence length and depth
(:func:`usp.planner.measure.scaling_runs`), each a pure function of those (fake tensors:
nothing depends on data, on the process or on what ran before). :class:`Measurements`
holds them. With ``jobs = 1`` each is measured here when it is first asked for
(:meth:`Measurements.footprint`), in the order the search asks. With ``jobs = N > 1``,
N spawned worker processes measure them: the search says early what it will need
(:meth:`Measurements.want`; ``urgent`` for what it needs next), at most N runs are in
flight, the most urgent first, and :meth:`Measurements.footprint` waits for its own.
Only the order and the place of the runs differ, so the results are the same for every
``jobs`` (``tests/test_planner_speed.py`` compares the JSON of 1 and 2 jobs).

Failures: an error in a worker is raised here as the same exception with the same
message (a :class:`usp.errors.UspError` stays one: ``usp plan`` exits 2 with its
message, as in process); the other workers are stopped, nothing waits for them. A
worker that dies (killed, out of memory) ends the plan with :class:`WorkerError`.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from usp.errors import UspError
from usp.planner.measure import Footprint, Layout, Target, from_runs, measure, scaling_runs

#: how worker processes start: a fresh interpreter (torch is not fork-safe once loaded)
START_METHOD = "spawn"


class WorkerError(UspError, RuntimeError):
    """A planning worker process died or sent back what could not be read."""


def default_jobs() -> int:
    """``usp plan``'s default ``--jobs``: two workers where there are two CPUs."""
    return max(1, min(2, os.cpu_count() or 1))


_Key = tuple[Layout, int, "int | None"]  # (layout, seq_len, layers)


class Measurements:
    """Footprints of a target's layouts at full depth, by ``(layout, seq_len)``; see the
    module docstring. Use as a context manager (the workers end with it)."""

    def __init__(self, target: Target, jobs: int = 1) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self.target = target
        self.jobs = jobs
        self.runs = 0  # measurements made (each depth one)
        self._done: dict[_Key, Footprint] = {}
        self._pending: list[_Key] = []  # wanted, not started; the first starts first
        self._running: dict[Future, _Key] = {}
        self._executor: ProcessPoolExecutor | None = None

    # ----------------------------------------------------------------- the search's side
    def want(self, layout: Layout, seq_len: int, *, urgent: bool = False) -> None:
        """Say that :meth:`footprint` will be asked for this; ``urgent``: before what
        was wanted so far. (In process, nothing runs ahead of its :meth:`footprint`.)"""
        if self.jobs == 1:
            return
        keys = [k for k in self._keys(layout, seq_len) if k not in self._done]
        keys = [k for k in keys if k not in self._running.values()]
        self._pending = [k for k in self._pending if k not in keys]
        self._pending = keys + self._pending if urgent else self._pending + keys
        self._start()

    def footprint(self, layout: Layout, seq_len: int) -> Footprint:
        """The layout's footprint at ``seq_len`` and the model's full depth."""
        keys = self._keys(layout, seq_len)
        if self.jobs == 1:
            for key in keys:
                if key not in self._done:
                    self._done[key] = _run(self.target, *key)
                    self.runs += 1
        else:
            self.want(layout, seq_len, urgent=True)
            while any(key not in self._done for key in keys):
                self._collect()
        return from_runs(self.target.model, [self._done[key] for key in keys])

    def _keys(self, layout: Layout, seq_len: int) -> list[_Key]:
        return [(layout, seq_len, layers) for layers in scaling_runs(self.target.model)]

    # ----------------------------------------------------------------- the workers' side
    def _start(self) -> None:
        """Start pending runs until ``jobs`` are in flight."""
        while self._pending and len(self._running) < self.jobs:
            key = self._pending.pop(0)
            future = self._pool().submit(_run_in_worker, self.target, *key)
            self._running[future] = key

    def _collect(self) -> None:
        """Wait for a run to end, keep its footprint and start the next one."""
        finished, _ = wait(self._running, return_when=FIRST_COMPLETED)
        for future in finished:
            key = self._running.pop(future)
            try:
                self._done[key] = _unpack(future.result())
            except BrokenProcessPool as err:
                self.close()
                raise WorkerError(
                    f"a usp plan worker process died while measuring {key[0]} at "
                    f"{key[1]:,} tokens ({err}); rerun with --jobs 1 to measure in process"
                ) from None
            except BaseException:
                self.close()
                raise
            self.runs += 1
        self._start()

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            context = multiprocessing.get_context(START_METHOD)
            self._executor = ProcessPoolExecutor(
                self.jobs, mp_context=context, initializer=_init_worker
            )
        return self._executor

    def close(self) -> None:
        """Stop the workers now (a run in flight is abandoned, nothing waits for it)."""
        executor, self._executor = self._executor, None
        self._pending.clear()
        self._running.clear()
        if executor is None:
            return
        processes = list(getattr(executor, "_processes", {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()

    def __enter__(self) -> Measurements:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(target: Target, layout: Layout, seq_len: int, layers: int | None) -> Footprint:
    return measure(target.at(seq_len), layout, layers=layers)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing; the CPUs are the workers'


def _run_in_worker(target: Target, layout: Layout, seq_len: int, layers: int | None):
    """One run in a worker: ``("ok", footprint)``, or the exception when it pickles
    (it is then raised in the parent as it was), else ``("error", class name, message)``."""
    try:
        return "ok", _run(target, layout, seq_len, layers)
    except Exception as err:  # noqa: BLE001 (every error goes back to the parent)
        try:
            pickle.loads(pickle.dumps(err))
        except Exception:  # noqa: BLE001
            return "error", type(err).__name__, str(err), isinstance(err, UspError)
        raise


def _unpack(result) -> Footprint:
    if result[0] == "ok":
        return result[1]
    _, name, message, usp_error = result
    if usp_error:
        raise WorkerError(message)
    raise RuntimeError(f"{name}: {message}")

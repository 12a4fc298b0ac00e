"""The plan's measurements, in this process or in worker processes (``usp plan --jobs``).

A plan measures many independent steps: a layout at a sequence length, at the depths of
:func:`usp.planner.footprint.scaling_runs`, each a pure function of those (fake tensors:
nothing depends on data, on the process or on what ran before). :class:`Measurements`
holds them by ``(layout, seq_len)``. With ``jobs = 1`` each is measured here when it is
first asked for (:meth:`Measurements.footprint`), in the order the search asks. With
``jobs = N > 1``, N spawned worker processes measure them, both depths of one in the
same worker (the second reuses most of the fake-tensor cache the first filled): the
search says early what it will need (:meth:`Measurements.want`; ``urgent`` for what it
waits for next), at most N are in flight, the most urgent first, and
:meth:`Measurements.footprint` waits for its own. Only the order and the place of the
runs differ, so the results are the same for every ``jobs``
(``tests/planner/test_planner.py`` compares the JSON of 1 and 2 jobs). A program that
calls :func:`usp.planner.plan.plan` with ``jobs > 1`` needs the usual
``if __name__ == "__main__":`` guard (spawned workers import the main module).

Failures: an error in a worker is raised here as the same exception with the same
message (a :class:`usp.errors.UspError` stays one: ``usp plan`` exits 2 with its
message, as in process), and the workers are stopped (terminated: nothing waits for a
run in flight). A worker that dies (killed, out of memory) ends the plan with
:class:`WorkerError`, which says to rerun with ``--jobs 1``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import torch

from usp.errors import InputError, UspError
from usp.planner.footprint import Choice, Footprint, Target, from_runs, scaling_runs
from usp.planner.hardware import default_jobs  # noqa: F401 (usp plan's default --jobs)
from usp.planner.measure import measure

#: how worker processes start: a fresh interpreter (torch is not fork-safe once loaded)
START_METHOD = "spawn"


class WorkerError(UspError, RuntimeError):
    """A planning worker process died or sent back what could not be read."""


_Key = tuple[Choice, int]  # (layout, seq_len): the runs of every depth, in one worker
#: told of each finished measurement: (layout, seq_len, CPU seconds, measured so far,
#: asked for so far -- the search asks for more as it goes)
Progress = Callable[[Choice, int, float, int, int], None]


class Measurements:
    """Footprints of a target's layouts at full depth, by ``(layout, seq_len)``; see the
    module docstring. Use as a context manager (the workers end with it)."""

    def __init__(self, target: Target, jobs: int = 1, *, progress: Progress | None = None) -> None:
        if jobs < 1:
            raise InputError(f"jobs must be >= 1 (1: measure in this process), got {jobs}")
        self.target = target
        self.jobs = jobs
        self.progress = progress  # told of each measurement as it ends
        self._asked: set[_Key] = set()  # every (layout, seq_len) wanted or asked for so far
        self.runs = 0  # measurements made (one per depth)
        self.cpu_seconds = 0.0  # the CPU time they took, workers' included
        self.log: list[tuple[Choice, int, float]] = []  # (layout, seq_len, CPU seconds)
        self._done: dict[_Key, tuple[Footprint, ...]] = {}
        self._pending: list[_Key] = []  # wanted, not started; the first starts first
        self._running: dict[Future, _Key] = {}
        self._executor: ProcessPoolExecutor | None = None

    # ----------------------------------------------------------------- the search's side
    def want(self, choice: Choice, seq_len: int, *, urgent: bool = False) -> None:
        """Say that :meth:`footprint` will be asked for this; ``urgent``: before what
        was wanted so far. (In process, nothing runs ahead of its :meth:`footprint`.)"""
        key = (choice, seq_len)
        self._asked.add(key)
        if self.jobs == 1 or key in self._done or key in self._running.values():
            return
        if key in self._pending:
            if not urgent:
                return
            self._pending.remove(key)
        self._pending.insert(0, key) if urgent else self._pending.append(key)
        self._start()

    def footprint(self, choice: Choice, seq_len: int) -> Footprint:
        """The layout's footprint at ``seq_len`` and the model's full depth."""
        key = (choice, seq_len)
        self._asked.add(key)
        if self.jobs == 1:
            if key not in self._done:
                self._keep(key, _timed_runs(self.target, choice, seq_len))
        else:
            self.want(choice, seq_len, urgent=True)
            while key not in self._done:
                self._collect()
        return from_runs(self.target.model, list(self._done[key]))

    # ----------------------------------------------------------------- the workers' side
    def _start(self) -> None:
        """Start pending tasks until ``jobs`` are in flight."""
        while self._pending and len(self._running) < self.jobs:
            key = self._pending.pop(0)
            future = self._pool().submit(_runs_in_worker, self.target, *key)
            self._running[future] = key

    def _collect(self) -> None:
        """Wait for a task to end, keep its footprints and start the next one."""
        finished, _ = wait(self._running, return_when=FIRST_COMPLETED)
        for future in finished:
            key = self._running.pop(future)
            try:
                self._keep(key, _unpack(future.result()))
            except BrokenProcessPool as err:
                self.close()
                raise WorkerError(
                    f"a usp plan worker process died while measuring {key[0]} at "
                    f"{key[1]:,} tokens ({err}); rerun with --jobs 1 to measure in process"
                ) from None
            except BaseException:
                self.close()
                raise
        self._start()

    def _keep(self, key: _Key, timed: tuple[tuple[Footprint, ...], float]) -> None:
        """Keep a measurement's footprints (one per depth) and its CPU seconds."""
        footprints, seconds = timed
        self._done[key] = footprints
        self.runs += len(footprints)
        self.cpu_seconds += seconds
        self.log.append((*key, seconds))
        if self.progress is not None:
            self.progress(key[0], key[1], seconds, len(self._done), len(self._asked))

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
        # the pool's own dict of workers (a worker it starts after this point lands in it
        # too) and the thread that manages them, which shutdown() lets go of
        processes = getattr(executor, "_processes", None) or {}
        manager = getattr(executor, "_executor_manager_thread", None)
        executor.shutdown(wait=False, cancel_futures=True)
        _stop(list(processes.values()))
        if manager is not None:
            manager.join(MANAGER_JOIN_S)  # it sees its workers gone and ends
        _stop(list(processes.values()))  # any it started meanwhile

    def __enter__(self) -> Measurements:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: seconds to wait for the pool's manager thread once its workers are stopped
MANAGER_JOIN_S = 30.0


def _stop(processes) -> None:
    """Terminate worker processes and wait until each has exited (a no-op for those
    already stopped)."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()


def _timed_runs(target: Target, choice: Choice, seq_len: int):
    """The runs of :func:`usp.planner.footprint.scaling_runs`, in order (in one process the
    second reuses most of the fake-tensor cache the first filled: same shapes but for
    the layer count), and the CPU seconds they took: ``(footprints, seconds)``."""
    started = time.process_time()
    at = target.at(seq_len)
    runs = tuple(measure(at, choice, layers=layers) for layers in scaling_runs(target.model))
    return runs, time.process_time() - started


#: seconds between a worker's checks that the plan that started it is still there
PARENT_POLL_S = 1.0


def _init_worker() -> None:
    """A worker ignores SIGINT (a Ctrl-C reaches every process of the terminal's group:
    the plan stops its workers itself, :mod:`usp.planner.cli`) and exits when the plan
    that started it is gone (killed with SIGKILL: nothing else would end it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch_parent() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch_parent, name="usp-plan-parent", daemon=True).start()
    torch.set_num_threads(1)  # fake tensors compute nothing; the CPUs are the workers'


def _runs_in_worker(target: Target, choice: Choice, seq_len: int):
    """:func:`_timed_runs` in a worker: ``("ok", (footprints, seconds))``; an error is
    raised as it was when it pickles (the parent raises it again), else sent back as
    ``("error", class name, message, whether it is a UspError)``."""
    try:
        return "ok", _timed_runs(target, choice, seq_len)
    except Exception as err:  # noqa: BLE001 (every error goes back to the parent)
        try:
            pickle.loads(pickle.dumps(err))
        except Exception:  # noqa: BLE001
            return "error", type(err).__name__, str(err), isinstance(err, UspError)
        raise


def _unpack(result):
    if result[0] == "ok":
        return result[1]
    _, name, message, usp_error = result
    if usp_error:
        raise WorkerError(message)
    raise RuntimeError(f"{name}: {message}")

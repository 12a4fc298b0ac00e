"""Run a test body on N gloo ranks on CPU, reusing worker processes across tests.

Why a pool: importing torch and creating a gloo world costs seconds per process; a test
suite with dozens of distributed tests would spend most of its time there. A pool of
``world_size`` workers is started once per world size (from a fork server that has
already imported torch) and every test sends it a function to run on all ranks.

Contract of :meth:`DistributedRunner.run`:
- ``fn`` must be a module-level function (it is pickled by reference); it runs on every
  rank after ``torch.distributed`` is initialised with the gloo backend, and its return
  values come back as a list indexed by rank.
- Any rank's exception fails the test with that rank's traceback. Ranks still blocked
  in a collective after a short grace period are killed, their stacks (from
  ``faulthandler``) are attached, and the pool is restarted for the next test.
- A call that does not finish within ``timeout`` seconds fails with every rank's stack.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# How long the other ranks may keep running after one rank failed, before we decide
# they are stuck in a collective waiting for the failed one.
_GRACE_AFTER_ERROR_S = 5.0
_STARTUP_TIMEOUT_S = 180.0


class DistributedTestError(AssertionError):
    """A rank raised, died or hung; the message holds every rank's story."""


# ----------------------------------------------------------------------------- both sides
_modules_when_frozen = 0


def freeze_imported_modules() -> None:
    """Move everything alive after the imports so far out of the cyclic garbage
    collector's reach (``gc.freeze``), once per batch of new imports.

    Why: the modules of torch, transformers, TRL, usp and the tests are hundreds of
    thousands of objects that live as long as the process (400k after importing the
    first four; a full collection of them alone takes 0.2 s), more once Dynamo and
    Inductor load, and every full collection walks all of them: the explicit
    ``gc.collect()`` in accelerate's ``Accelerator.free_memory`` (each HF Trainer's
    ``train``) and in usp's process-group shutdown (each in-process ``usp train``) were
    a tenth of the samples of a py-spy profile of the suite (2026-12-07), in the pooled
    ranks and in pytest's process; tests/integrations, rl and evaluation took 126 s
    before this and 70 s after. Frozen objects are still freed when their reference
    counts drop; only cycles among them are kept. Call it between tests, never inside
    one: a test's own objects stay collectable."""
    global _modules_when_frozen
    if len(sys.modules) != _modules_when_frozen:
        gc.collect()
        gc.freeze()
        _modules_when_frozen = len(sys.modules)


# ----------------------------------------------------------------------------- worker side
_worker_cache: dict[Any, Any] = {}


def worker_cached(key: Any, factory: Callable[[], Any]) -> Any:
    """Per-worker memo for expensive objects (e.g. process groups) shared by many tests.

    Process groups are collective to create, so every rank must ask for the same keys
    in the same order, which is the case when all ranks run the same test body.
    """
    if key not in _worker_cache:
        _worker_cache[key] = factory()
    return _worker_cache[key]


def _worker_main(rank: int, world_size: int, store_path: str, conn, dump_path: str) -> None:
    import torch
    import torch.distributed as dist

    dump_file = open(dump_path, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=600)
    )
    conn.send(("ready", None))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            break
        if not payload:
            break
        try:
            fn, args, kwargs = pickle.loads(payload)  # may import the test's module
            freeze_imported_modules()
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # report everything, including KeyboardInterrupt in a rank
            conn.send(("error", traceback.format_exc()))
    gc.unfreeze()  # the interpreter's shutdown collects everything again
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side
def start_fork_server() -> None:
    """Start the ranks' fork server without waiting for it: its imports (seconds of CPU)
    run on another core while pytest collects the tests; the first pool's start waits
    for whatever is left of them. Idempotent (a running server is kept)."""
    _context()


def _context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Workers fork from a server that already imported what the tests' ranks use
        # (tests/helpers/forkserver_preload.py names it: torch, transformers' model base,
        # Dynamo, TRL, ...), so they start in milliseconds instead of re-importing it
        # each; were that module not importable, the ranks would import for themselves.
        ctx.set_forkserver_preload(["forkserver_preload"])
        _start_forkserver_with(os.path.dirname(os.path.abspath(__file__)))
        return ctx
    return mp.get_context("spawn")


def _start_forkserver_with(helpers_dir: str) -> None:
    """Start the fork server with this directory importable: Python 3.11's fork server
    ignores the parent's ``sys.path`` while it imports its preload modules, and reads
    ``PYTHONPATH`` from the environment it starts in (restored here at once)."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (helpers_dir, before) if p)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


class WorkerPool:
    """``world_size`` long-lived gloo ranks."""

    def __init__(self, world_size: int, ctx: mp.context.BaseContext):
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix=f"usp-pool{world_size}-")
        store_path = os.path.join(self._tmp.name, "store")
        self._dump_paths = [
            os.path.join(self._tmp.name, f"rank{r}.stack") for r in range(world_size)
        ]
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, store_path, child_conn, self._dump_paths[rank]),
                daemon=True,
                name=f"usp-test-rank{rank}",
            )
            proc.start()
            child_conn.close()
            self._conns.append(parent_conn)
            self._procs.append(proc)
        replies = self._collect(timeout=_STARTUP_TIMEOUT_S, what="start-up")
        bad = [r for r, (status, _) in replies.items() if status != "ready"]
        if bad:
            self.kill()
            raise DistributedTestError(self._describe(replies, "start-up failed"))

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        replies = self._collect(timeout=timeout, what=f"{fn.__qualname__}")
        errors = {r: v for r, (status, v) in replies.items() if status != "ok"}
        if errors or len(replies) < self.world_size:
            message = self._describe(
                replies, f"{fn.__qualname__} failed on {self.world_size} ranks"
            )
            self.kill()
            raise DistributedTestError(message)
        return [replies[r][1] for r in range(self.world_size)]

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        """Gather one reply per rank; stop early (after a grace period) once one failed."""
        replies: dict[int, tuple[str, Any]] = {}
        pending = {self._conns[r]: r for r in range(self.world_size)}
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            ready = mp_connection.wait(list(pending), timeout=deadline - now)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    self._procs[rank].join(timeout=5)
                    code = self._procs[rank].exitcode
                    replies[rank] = ("died", f"rank {rank} exited unexpectedly (exit code {code})")
            if any(status not in ("ok", "ready") for status, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        for rank in pending.values():
            replies[rank] = (
                "hung",
                self._stack_of(rank, f"no reply to {what} within the time limit"),
            )
        return replies

    def _stack_of(self, rank: int, reason: str) -> str:
        proc = self._procs[rank]
        if proc.is_alive() and proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.5)
            except ProcessLookupError:
                pass
        try:
            with open(self._dump_paths[rank]) as f:
                stack = f.read().strip()
        except OSError:
            stack = ""
        return f"{reason}; its stack:\n{stack or '(no stack dump available)'}"

    def _describe(self, replies: dict[int, tuple[str, Any]], headline: str) -> str:
        lines = [headline]
        for rank in sorted(replies):
            status, value = replies[rank]
            if status in ("ok", "ready"):
                continue
            lines.append(f"--- rank {rank}: {status} ---\n{value}")
        return "\n".join(lines)

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._tmp.cleanup()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead worker's pipe is already closed
                conn.send_bytes(b"")
        for proc in self._procs:
            proc.join(timeout=10)
        self.kill()


class DistributedRunner:
    """Owns one worker pool per world size for a pytest session."""

    def __init__(self) -> None:
        self._ctx = _context()
        self._pools: dict[int, WorkerPool] = {}

    def run(
        self,
        fn: Callable,
        *args: Any,
        world_size: int,
        timeout: float = 120.0,
        **kwargs: Any,
    ) -> list:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = WorkerPool(world_size, self._ctx)
        try:
            return pool.run(fn, args, kwargs, timeout)
        except DistributedTestError:
            self._pools.pop(world_size, None)  # killed by run(); a fresh one next time
            raise

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

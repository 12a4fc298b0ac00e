"""Leaving a distributed job so that no rank aborts at interpreter shutdown
(:func:`shutdown`).

Gloo runs each collective on a worker thread of its process group, and that thread lets
go of the collective's tensors only after ``wait()`` has returned in Python. Freeing a
tensor made in Python needs the GIL, and once the interpreter is shutting down a thread
that asks for the GIL is stopped inside a C++ destructor: "terminate called without an
active exception" (SIGABRT) after the job's work is done. A worker is that late only when
it is starved (a loaded machine), but nothing else makes it finish first: a barrier waits
for the earlier collectives to complete, not for their threads to let go, and
``dist.destroy_process_group`` unregisters a group without ending its threads -- they end
when the group's last reference goes, and after an FSDP run torch's DTensor caches (the
sharding propagation and redistribution planner caches, ``MeshTopoInfo``, the mesh
registry) hold every DeviceMesh, and so every group, until interpreter shutdown.

So, in order: the job's garbage is collected (in this thread: a model's sharded tensors
are freed here, not by a worker); this process's other threads are given time to go quiet
while the GIL is free (a worker still holding a Python-made tensor runs, takes the GIL,
frees it and goes back to waiting for work); then the topology's groups are destroyed
(after a barrier, subgroups first, then another barrier) and the default group last.
Every collective from then on is a tensorless barrier (:func:`tensorless_barrier`), so
whenever the groups' threads end -- now, or at interpreter shutdown while torch's caches
hold them -- they have nothing to free that needs the GIL.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import torch.distributed as dist

from usp.process_groups.launch import tensorless_barrier

#: how long :func:`wait_for_quiet_threads` waits at most (seconds)
QUIET_TIMEOUT_S = 10.0
_POLL_S = 0.005


def shutdown(topology) -> None:
    """End this process's part of a distributed job (module docstring): collective when
    a process group exists (every rank calls it); the same on a single-process
    topology with a world of one. Idempotent."""
    gc.collect()  # the job's model and optimizer: freed by this thread, not a worker
    wait_for_quiet_threads()
    if not topology.single_process:
        topology.destroy()  # a barrier, its groups, a barrier
    elif dist.is_initialized():
        tensorless_barrier(topology.device_type)  # no rank closes what a peer still reads
    if dist.is_initialized():
        dist.destroy_process_group()


def busy_threads() -> int | None:
    """How many threads of this process other than the calling one are running or
    runnable (``R``) or in uninterruptible sleep (``D``); None without ``/proc``."""
    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    busy = 0
    for task in tasks:
        if int(task) == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as file:
                stat = file.read()
        except OSError:
            continue  # the thread has ended
        state = stat[stat.rindex(")") + 2]  # the field after "(thread name)"
        busy += state in "RD"
    return busy


def wait_for_quiet_threads(timeout_s: float = QUIET_TIMEOUT_S) -> bool:
    """Sleep (the GIL free) until no other thread of this process is busy in two checks
    in a row, at most ``timeout_s``; whether they went quiet (False without ``/proc``).
    A gloo worker that still has to free a Python-made tensor is runnable or waiting for
    the GIL, which it gets while this sleeps."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while True:
        busy = busy_threads()
        if busy is None:
            return False
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)

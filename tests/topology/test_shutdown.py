"""Leaving a distributed job (usp.process_groups.shutdown): before the last barriers, this
process's other threads are given time to go quiet with the GIL free, so that no gloo
worker still holds a Python-made tensor when the interpreter shuts down (it would abort
the process: "terminate called without an active exception").

Checked here without launches: a busy thread is seen and waited for, and a quiet process
is recognised at once; on 4 gloo ranks, right after collectives on Python tensors, the
workers go quiet; a destroyed topology lets go of its groups and meshes.
``benchmarks/resume_soak.py`` runs real launches and counts the ranks that died at exit.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from usp_cases import topology

import usp
from usp.process_groups.shutdown import busy_threads, wait_for_quiet_threads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="threads' states are read from /proc"
)


def test_a_busy_thread_is_waited_for():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        seen = max(busy_threads() for _ in range(50))
        assert seen >= 1, "a spinning thread is running or runnable"
        started = time.monotonic()
        assert wait_for_quiet_threads(timeout_s=0.3) is False
        assert time.monotonic() - started >= 0.3
    finally:
        stop.set()
        spinner.join()
    assert wait_for_quiet_threads(timeout_s=10.0) is True


def test_a_sleeping_thread_is_quiet():
    done = threading.Event()
    sleeper = threading.Thread(target=done.wait, daemon=True)
    sleeper.start()
    try:
        assert wait_for_quiet_threads(timeout_s=10.0) is True
    finally:
        done.set()
        sleeper.join()


def collectives_then_quiet():
    """Collectives on Python-made tensors over every group of a topology, the tensors
    dropped at once: the gloo workers then go quiet (they have let go of them)."""
    topo = topology(2, 2)
    for group in (topo.ulysses_group, topo.ring_group, topo.sp_group, dist.group.WORLD):
        for _ in range(5):
            tensor = torch.ones(4096)
            dist.all_reduce(tensor, group=group)
            del tensor
    started = time.monotonic()
    quiet = wait_for_quiet_threads(timeout_s=30.0)
    return quiet, time.monotonic() - started


def test_gloo_workers_go_quiet_after_collectives(distributed):
    for quiet, seconds in distributed.run(collectives_then_quiet, world_size=4, timeout=120):
        assert quiet, f"not quiet after {seconds:.1f} s"


def destroyed_topology():
    topo = usp.build_topology(2, 2)  # not the harness's cached one: destroyed here
    dist.all_reduce(torch.ones(8), group=topo.ring_group)
    topo.destroy()
    return topo.destroyed, topo._groups, topo._mesh, topo._sp_mesh, topo._dp_sp_mesh  # noqa: SLF001


def test_a_destroyed_topology_lets_go_of_its_groups(distributed):
    for destroyed, groups, *meshes in distributed.run(
        destroyed_topology, world_size=4, timeout=120
    ):
        assert destroyed and meshes == [None, None, None]
        assert set(groups) == {"ulysses", "ring", "dp", "sp", "dp_sp"}
        assert all(group is None for group in groups.values())

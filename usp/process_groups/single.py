"""The topology of one process without process groups: what ``usp.Plan(None)`` holds.

:class:`SingleProcess` answers every question a :class:`~usp.process_groups.Topology`
answers, for a world of one: degrees 1, coordinates 0, no groups (None), no meshes, no
byte counters, the CPU. Code that receives a plan's topology asks it (``dp_degree``,
``rank``, ``single_process``) instead of testing for None. :data:`SINGLE_PROCESS` is the
one instance (it holds no state); :func:`as_topology` turns a caller's None into it.
"""

from __future__ import annotations


class SingleProcess:
    """One process, no process group (see the module docstring). Leaving a ``with``
    block or :meth:`destroy` does nothing: there is nothing to tear down."""

    #: no process group: collectives, FSDP and agreement are skipped
    single_process = True
    rank = 0
    world_size = 1
    device_type = "cpu"
    ulysses_degree = ring_degree = sp_degree = dp_degree = 1
    ulysses_rank = ring_rank = sp_rank = dp_rank = 0
    ulysses_group = ring_group = sp_group = dp_group = dp_sp_group = None
    comm_stats = None
    destroyed = False

    def __enter__(self) -> SingleProcess:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass

    def destroy(self) -> None:
        pass

    def describe(self) -> str:
        return "single process"

    def __repr__(self) -> str:
        return "SingleProcess()"


#: the single-process topology
SINGLE_PROCESS = SingleProcess()


def as_topology(given):
    """``given`` (a Topology or a SingleProcess), or :data:`SINGLE_PROCESS` for None:
    where a caller's ``topology=None`` ("one process") enters usp."""
    return SINGLE_PROCESS if given is None else given

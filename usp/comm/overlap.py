"""Keep a compiled graph's communication overlapped with compute: an Inductor
scheduler pass, and the compile options that install it.

The ring's eager loop posts the shift of the next K/V block, computes on the current
one, then waits; a compiled graph holds the same three nodes per step (the collective,
the kernel, the ``wait_tensor``) with nothing tying the kernel between the other two.
Inductor's default order moves them apart (measured on torch 2.13, CPU, u1 x r4: its
peak-memory reordering posts and waits every shift of the forward back to back before
the first kernel; without it, the fused kernel of every step's LSE merge pulls the
kernels of later steps ahead of their shift). :func:`overlap_communication` orders the
nodes as the code wrote them (a fused node where its last member was) and starts each
collective as soon as its inputs exist, so every shift is in flight during the kernel
that was written between it and its wait. ``benchmarks/README.md`` (*Compiled*) shows
the generated code before and after.
"""

from __future__ import annotations

import heapq
import logging

_log = logging.getLogger("usp.comm")


def overlap_communication(snodes: list) -> list:
    """Inductor scheduler pass (``reorder_for_compute_comm_overlap_passes``): a list
    schedule of ``snodes`` whose ready nodes run collectives first, then the rest in
    the order of the graph (a fused node at its last member's place)."""
    from torch._inductor.comms import contains_collective

    producer = {}
    for snode in snodes:
        for name in snode.get_buffer_names():
            producer[name] = snode
    waiting_on = {
        snode: {dep.name for dep in snode.unmet_dependencies if dep.name in producer}
        for snode in snodes
    }
    users: dict[str, list] = {}
    for snode, names in waiting_on.items():
        for name in names:
            users.setdefault(name, []).append(snode)
    position = {snode: index for index, snode in enumerate(sorted(snodes, key=_last_member))}

    def priority(snode) -> tuple[int, int]:
        return (0 if contains_collective(snode) else 1, position[snode])

    ready = [(priority(s), position[s], s) for s, names in waiting_on.items() if not names]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, snode = heapq.heappop(ready)
        order.append(snode)
        for name in snode.get_buffer_names():
            for user in users.get(name, ()):
                waiting_on[user].discard(name)
                if not waiting_on[user]:
                    heapq.heappush(ready, (priority(user), position[user], user))
    if len(order) != len(snodes):  # a dependency this pass does not see: keep Inductor's
        _log.warning(
            "usp overlap_communication scheduled %d of %d nodes; kept Inductor's order",
            len(order), len(snodes),
        )  # fmt: skip
        return snodes
    return order


def _last_member(snode) -> int:
    return snode.max_order


def compile_options() -> dict:
    """Inductor options for a model with usp attention:
    ``torch.compile(model, fullgraph=True, options=usp.compile_options())`` schedules
    with :func:`overlap_communication` (what :func:`usp.train.parallelize.
    compile_layers` passes with Inductor). Without them the compiled graph is the same
    and as exact, its communication less overlapped."""
    return {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [overlap_communication],
    }

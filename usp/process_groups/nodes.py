"""Ranks and nodes: node descriptions and lists, and which groups span nodes.

Ulysses and ring groups of both placements are arithmetic progressions tiling the world
(:class:`Progressions`), so for uniform nodes of ``n`` consecutive ranks whether (and how
many) groups span nodes has a closed form: that is what lets a world of 2**31 ranks be
validated at once. An explicit node list (an observed launch) is scanned group by group.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd
from typing import NamedTuple

from usp.errors import TopologyError

ULYSSES_IN_NODE = "ulysses-in-node"
RING_IN_NODE = "ring-in-node"
PLACEMENTS = (ULYSSES_IN_NODE, RING_IN_NODE)


def divisors(n: int) -> list[int]:
    """Ascending divisors of ``n >= 1`` (``O(sqrt(n))``: 46k steps at 2**31)."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def describe_uniform_nodes(nodes: int | str, ranks_per_node: int | str) -> str:
    """``"1 node x 4 ranks"``, ``"2 nodes x 8 ranks"`` (either may be ``"auto"``)."""
    return (
        f"{nodes} node{'' if nodes == 1 else 's'} x "
        f"{ranks_per_node} rank{'' if ranks_per_node == 1 else 's'}"
    )


def describe_node_shape(sizes: Sequence[int]) -> str:
    """``"1 node x 4 ranks"``, ``"2 nodes x 2 ranks"`` or ``"2 nodes with 4 and 2 ranks"``."""
    n = len(sizes)
    if len(set(sizes)) == 1:
        return describe_uniform_nodes(n, sizes[0])
    shown = [str(s) for s in sizes[:8]] + ([f"... ({n - 8} more)"] if n > 8 else [])
    return f"{n} node{'' if n == 1 else 's'} with {', '.join(shown[:-1])} and {shown[-1]} ranks"


def node_sizes_of(node_of_rank: Sequence[int]) -> tuple[int, ...]:
    """Ranks per node id; node ids must be ``0 .. N-1``, numbered by lowest rank."""
    if not node_of_rank:
        raise TopologyError("node_of_rank is empty")
    sizes: dict[int, int] = {}
    for rank, node in enumerate(node_of_rank):
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise TopologyError(f"node_of_rank[{rank}] = {node!r} is not a node id >= 0")
        if node not in sizes and node != len(sizes):
            raise TopologyError(
                f"node_of_rank[{rank}] = {node}: node ids must be 0, 1, ... in the order of "
                f"each node's lowest rank (expected {len(sizes)} for a new node)"
            )
        sizes[node] = sizes.get(node, 0) + 1
    return tuple(sizes[n] for n in range(len(sizes)))


def check_nodes(world_size: int, ranks_per_node: int, node_of_rank) -> None:
    """Uniform nodes (``node_of_rank`` None) must tile the world; a node list must name
    every rank's node, its largest node being ``ranks_per_node`` ranks."""
    nodes = node_of_rank
    if nodes is None:
        if world_size % ranks_per_node:
            raise TopologyError(
                f"world_size({world_size}) is not a multiple of "
                f"ranks_per_node({ranks_per_node}): with ranks_per_node every node "
                "runs the same number of ranks (give node_of_rank for uneven nodes)"
            )
        return
    if not isinstance(nodes, tuple) or len(nodes) != world_size:
        raise TopologyError(f"node_of_rank must be a tuple of world_size({world_size}) node ids")
    largest = max(node_sizes_of(nodes))
    if largest != ranks_per_node:
        raise TopologyError(
            f"ranks_per_node({ranks_per_node}) must be the size of the largest node "
            f"in node_of_rank ({largest} ranks)"
        )


# ----------------------------------------------------------------------------- groups vs nodes
class Progressions(NamedTuple):
    """Ulysses or ring groups: arithmetic progressions tiling the world. The world is cut
    into blocks of ``stride * count`` consecutive ranks; group ``block * stride + rho``
    (``0 <= rho < stride``) is ``start, start + stride, ...`` with ``count`` members."""

    stride: int
    count: int
    world_size: int

    @property
    def block(self) -> int:
        return self.stride * self.count

    @property
    def num_groups(self) -> int:
        return self.world_size // self.count

    def members(self, index: int) -> range:
        block, rho = divmod(index, self.stride)
        start = block * self.block + rho
        return range(start, start + self.block, self.stride)


def ulysses_progressions(placement: str, world_size: int, r: int, u: int) -> Progressions:
    return Progressions(1 if placement == ULYSSES_IN_NODE else r, u, world_size)


def ring_progressions(placement: str, world_size: int, r: int, u: int) -> Progressions:
    return Progressions(u if placement == ULYSSES_IN_NODE else 1, r, world_size)


def crosses(members: range, n: int, node_of_rank) -> bool:
    if node_of_rank is None:  # members ascend and nodes are contiguous
        return members[0] // n != members[-1] // n
    return len({node_of_rank[m] for m in members}) > 1


def first_crossing(groups: Progressions, n: int, node_of_rank=None) -> int | None:
    """Index of the first group spanning nodes of ``n`` ranks (or of ``node_of_rank``)."""
    if node_of_rank is not None:
        members = (groups.members(i) for i in range(groups.num_groups))
        return next((i for i, m in enumerate(members) if crosses(m, n, node_of_rank)), None)
    block = groups.block
    if groups.count == 1 or n == groups.world_size or n % block == 0:
        return None
    # The node boundary at rank n falls strictly inside block n // block, at offset beta;
    # the first group of that block reaching past it is the first crossing one.
    beta = n % block
    return (n // block) * groups.stride + max(0, beta - (groups.count - 1) * groups.stride)


def crossing_count(groups: Progressions, n: int, node_of_rank=None) -> int:
    """How many groups span nodes (closed form for uniform nodes)."""
    if node_of_rank is not None:
        return sum(crosses(groups.members(i), n, node_of_rank) for i in range(groups.num_groups))
    if first_crossing(groups, n) is None:
        return 0
    stride, block = groups.stride, groups.block
    span = (groups.count - 1) * stride  # a group covers (first, first + span]
    if span >= n:
        return groups.num_groups  # every group is longer than a node

    # Each group then holds at most one node boundary: count, per boundary j * n, the
    # groups of its block that straddle it; the offsets repeat with period p in j.
    def straddling(j: int) -> int:
        beta = (j * n) % block
        return 0 if beta == 0 else min(stride - 1, beta - 1) - max(0, beta - span) + 1

    period = block // gcd(block, n)
    full, rest = divmod(groups.world_size // n - 1, period)
    per_period = sum(straddling(j) for j in range(1, period + 1)) if full else 0
    return full * per_period + sum(straddling(j) for j in range(1, rest + 1))


def fitting_ulysses_degrees(
    sp_size: int,
    ranks_per_node: int,
    placement: str = ULYSSES_IN_NODE,
    world_size: int | None = None,
    *,
    node_of_rank: Sequence[int] | None = None,
) -> list[int]:
    """Ulysses degrees ``u`` dividing ``sp_size`` whose groups all stay inside one node.

    Checked on the real layout (``world_size`` defaults to ``sp_size``), so it is right
    for both placements; ``node_of_rank`` gives an observed, possibly uneven, layout
    (then ``ranks_per_node`` is ignored). Always contains 1. Closed-form for uniform
    nodes: no list proportional to the world is built.
    """
    world = sp_size if world_size is None else world_size
    nodes = None if node_of_rank is None else tuple(node_of_rank)
    return [
        u
        for u in divisors(sp_size)
        if first_crossing(
            ulysses_progressions(placement, world, sp_size // u, u), ranks_per_node, nodes
        )
        is None
    ]

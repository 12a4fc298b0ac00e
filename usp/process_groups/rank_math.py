"""Pure rank math: global ranks <-> (dp, ring, ulysses) coordinates, nodes and groups.

Nothing here touches ``torch.distributed``; a :class:`RankMap` can be built and checked
for any world size up to :data:`MAX_WORLD_SIZE` without allocating anything proportional
to it (validation and single-group queries are closed-form; only the methods that list
every rank or every group materialise lists, up to :data:`MAX_LISTED_RANKS` ranks).

Conventions that the rest of ``usp`` relies on:

- Every rank has coordinates ``(dp, ring, ulysses)`` with ``0 <= dp < d``,
  ``0 <= ring < r`` and ``0 <= ulysses < u``; ``d * r * u == world_size``.
- ``sp_rank = ring * u + ulysses`` for both placements: the position of a rank inside
  its sequence-parallel replica. A rank's tokens are chunk ``ring`` of the ring layout,
  split again by the Ulysses all-to-all.
- Nodes: by default ranks sit on nodes the way torchrun numbers them, ``node = rank //
  ranks_per_node`` and ``local_rank = rank % ranks_per_node``. A launch observed at run
  time (see :mod:`usp.process_groups.launch`) may instead give every rank's node
  explicitly (``node_of_rank``): non-contiguous assignments and nodes of different sizes
  are then represented exactly. Node ids are numbered in the order of each node's lowest
  rank; ``local_rank`` is a rank's position among its node's ranks.
- Placements:

  * ``"ulysses-in-node"`` (default): ``rank = (dp * r + ring) * u + ulysses``. Ulysses
    groups are ``u`` contiguous ranks (inside one node when ``u`` divides
    ``ranks_per_node``); ring members are ``u`` ranks apart, so the ring crosses nodes.
  * ``"ring-in-node"``: ``rank = (dp * u + ulysses) * r + ring``. Ring groups are ``r``
    contiguous ranks; Ulysses members are ``r`` ranks apart.

- Group member lists: every Ulysses, ring and dp group lists its members in coordinate
  order, and that order is ascending in global rank, so the group rank torch assigns
  (torch sorts group members) equals the coordinate. ``sp_groups[i]`` lists members in
  ``sp_rank`` order; for ``"ring-in-node"`` that order is NOT ascending (``sp_rank`` 1
  is global rank ``r`` when ``u > 1``), so the sp group's torch rank is not ``sp_rank``.
- Group indices: ``ulysses_groups`` are ordered by ``(dp, ring)``, ``ring_groups`` by
  ``(dp, ulysses)``, ``sp_groups`` by ``dp`` and ``dp_groups`` by ``sp_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from math import gcd
from typing import NamedTuple

from usp.errors import TopologyError  # noqa: F401 - re-exported here

ULYSSES_IN_NODE = "ulysses-in-node"
RING_IN_NODE = "ring-in-node"
PLACEMENTS = (ULYSSES_IN_NODE, RING_IN_NODE)

# torch.distributed keeps ranks and world sizes in a C++ int: no launch can be larger.
MAX_WORLD_SIZE = 2**31 - 1
# Methods that list every rank or every group refuse worlds above this (about 100 MB of
# Python lists); everything else works at any size.
MAX_LISTED_RANKS = 2**20
# Groups longer than this are not scanned member by member for error messages.
_MAX_SCANNED_MEMBERS = 4096


class Coords(NamedTuple):
    dp: int
    ring: int
    ulysses: int


class RankInfo(NamedTuple):
    """Everything the rank math knows about one global rank."""

    rank: int
    node: int
    local_rank: int
    dp: int
    ring: int
    ulysses: int
    sp: int


def check_degree(name: str, value: object) -> int:
    """``value`` as an int >= 1, or a :class:`TopologyError` naming ``name``.

    ``bool`` is rejected although it is an ``int`` subclass: ``ulysses_degree=True`` is a
    bug, not a degree of 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise TopologyError(f"{name} must be an integer >= 1, got {value}")
    return value


def check_world_size(name: str, value: int) -> int:
    """``value`` (already an int >= 1) is at most :data:`MAX_WORLD_SIZE`."""
    if value > MAX_WORLD_SIZE:
        raise TopologyError(
            f"{name}({value}) exceeds the largest world torch.distributed can launch "
            f"({MAX_WORLD_SIZE} = 2**31 - 1 ranks)"
        )
    return value


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
    nodes = f"{n} node" + ("" if n == 1 else "s")
    if len(set(sizes)) == 1:
        return describe_uniform_nodes(n, sizes[0])
    shown = [str(s) for s in sizes[:8]] + ([f"... ({n - 8} more)"] if n > 8 else [])
    return f"{nodes} with {', '.join(shown[:-1])} and {shown[-1]} ranks"


def _rank(placement: str, r: int, u: int, dp: int, ring: int, ulysses: int) -> int:
    if placement == ULYSSES_IN_NODE:
        return (dp * r + ring) * u + ulysses
    return (dp * u + ulysses) * r + ring


class _Progressions(NamedTuple):
    """Groups that are arithmetic progressions tiling the world.

    The world is cut into blocks of ``stride * count`` consecutive ranks; inside a block,
    group ``rho`` (``0 <= rho < stride``) is ``rho, rho + stride, ...`` (``count``
    members). Group ``index = block * stride + rho``. Ulysses and ring groups of both
    placements have this shape, which makes node checks closed-form.
    """

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


def _ulysses_progressions(placement: str, world_size: int, r: int, u: int) -> _Progressions:
    # ulysses-in-node: u contiguous ranks; ring-in-node: u ranks r apart.
    return _Progressions(1 if placement == ULYSSES_IN_NODE else r, u, world_size)


def _ring_progressions(placement: str, world_size: int, r: int, u: int) -> _Progressions:
    # ulysses-in-node: r ranks u apart; ring-in-node: r contiguous ranks.
    return _Progressions(u if placement == ULYSSES_IN_NODE else 1, r, world_size)


class _Nodes:
    """Where ranks sit: uniform contiguous nodes (closed-form) or an explicit list."""

    def __init__(self, world_size: int, ranks_per_node: int, node_of_rank: tuple | None):
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.node_of_rank = node_of_rank

    def node_of(self, rank: int) -> int:
        if self.node_of_rank is None:
            return rank // self.ranks_per_node
        return self.node_of_rank[rank]

    # -------------------------------------------------------------- groups vs nodes
    def crosses(self, members: range) -> bool:
        if self.node_of_rank is None:  # members ascend, nodes are contiguous
            return self.node_of(members[0]) != self.node_of(members[-1])
        first = self.node_of_rank[members[0]]
        return any(self.node_of_rank[m] != first for m in members)

    def first_crossing(self, groups: _Progressions) -> int | None:
        """Index of the first group spanning nodes, or None."""
        if self.node_of_rank is not None:
            return next(
                (i for i in range(groups.num_groups) if self.crosses(groups.members(i))), None
            )
        n, block = self.ranks_per_node, groups.block
        if groups.count == 1 or n == self.world_size or n % block == 0:
            return None
        # The node boundary at rank n falls strictly inside block n // block, at offset
        # beta; the first group of that block reaching past it is the first crossing one
        # (blocks before it lie inside node 0).
        beta = n % block
        rho = max(0, beta - (groups.count - 1) * groups.stride)
        return (n // block) * groups.stride + rho

    def crossing_count(self, groups: _Progressions) -> int:
        """How many groups span nodes."""
        if self.node_of_rank is not None:
            return sum(self.crosses(groups.members(i)) for i in range(groups.num_groups))
        if self.first_crossing(groups) is None:
            return 0
        n, stride, count = self.ranks_per_node, groups.stride, groups.count
        span = (count - 1) * stride  # a group covers (first, first + span]
        if span >= n:
            return groups.num_groups  # every group is longer than a node
        # Each group contains at most one node boundary: count, per boundary j * n, the
        # groups of its block that straddle it. The offsets repeat with period p in j.
        block = groups.block

        def straddling(j: int) -> int:
            beta = (j * n) % block
            if beta == 0:
                return 0
            return min(stride - 1, beta - 1) - max(0, beta - span) + 1

        boundaries = self.world_size // n - 1
        period = block // gcd(block, n)
        full, rest = divmod(boundaries, period)
        per_period = sum(straddling(j) for j in range(1, period + 1)) if full else 0
        return full * per_period + sum(straddling(j) for j in range(1, rest + 1))

    def nodes_of(self, members: range) -> list[int] | None:
        """Sorted nodes of a group, or None when the group is too long to scan."""
        if len(members) > _MAX_SCANNED_MEMBERS:
            return None
        return sorted({self.node_of(m) for m in members})


def _short_list(values: Sequence[int], limit: int = 8) -> str:
    if len(values) <= limit:
        return str(list(values))
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} ranks)]"


def _check_listable(what: str, world_size: int) -> None:
    if world_size > MAX_LISTED_RANKS:
        raise TopologyError(
            f"{what} lists all {world_size} ranks, more than {MAX_LISTED_RANKS}; "
            "use the per-rank and per-group methods (info, ulysses_group, ...) instead"
        )


class _SpOrder(Sequence):
    """The members of one sp group in ``sp_rank`` order, computed on access."""

    def __init__(self, rank_map: RankMap, dp: int):
        self._map, self._dp = rank_map, dp

    def __len__(self) -> int:
        return self._map.sp_degree

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sp rank {i} out of range [0, {len(self)})")
        u = self._map.ulysses_degree
        return self._map.rank_of(self._dp, i // u, i % u)


@dataclass(frozen=True)
class RankMap:
    """The placement of ``world_size`` ranks on a ``dp x ring x ulysses`` grid.

    Validates in ``__post_init__``; every error is a :class:`TopologyError` whose message
    prints each factor and the target. See the module docstring for the conventions.

    ``node_of_rank`` (one node id per rank) describes an observed launch; ``None`` means
    uniform contiguous nodes of ``ranks_per_node`` ranks. Use :meth:`from_nodes` to build
    one from a node list: it derives ``ranks_per_node`` (the largest node) and stores
    ``None`` when the list is uniform and contiguous, so equal placements compare equal.
    """

    world_size: int
    ranks_per_node: int
    ulysses_degree: int
    ring_degree: int
    dp_degree: int
    placement: str = ULYSSES_IN_NODE
    allow_cross_node_ulysses: bool = False
    node_of_rank: tuple[int, ...] | None = None

    @classmethod
    def from_nodes(
        cls,
        node_of_rank: Sequence[int],
        ulysses_degree: int,
        ring_degree: int,
        dp_degree: int,
        placement: str = ULYSSES_IN_NODE,
        allow_cross_node_ulysses: bool = False,
    ) -> RankMap:
        nodes = tuple(node_of_rank)
        sizes = node_sizes_of(nodes)
        rpn = max(sizes)
        contiguous = nodes == tuple(rank // rpn for rank in range(len(nodes)))
        return cls(
            world_size=len(nodes),
            ranks_per_node=rpn,
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            dp_degree=dp_degree,
            placement=placement,
            allow_cross_node_ulysses=allow_cross_node_ulysses,
            node_of_rank=None if contiguous and len(set(sizes)) == 1 else nodes,
        )

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node", "ulysses_degree", "ring_degree", "dp_degree"):
            check_degree(name, getattr(self, name))
        check_world_size("world_size", self.world_size)
        if self.placement not in PLACEMENTS:
            raise TopologyError(
                f"placement must be one of {', '.join(map(repr, PLACEMENTS))}, got {self.placement!r}"
            )
        if not isinstance(self.allow_cross_node_ulysses, bool):
            raise TopologyError(
                f"allow_cross_node_ulysses must be a bool, got {self.allow_cross_node_ulysses!r}"
            )
        self._check_nodes()
        self._check_sizes()
        if not self.allow_cross_node_ulysses:
            self._check_ulysses_inside_nodes()

    # ------------------------------------------------------------------ validation
    def _check_nodes(self) -> None:
        nodes = self.node_of_rank
        if nodes is None:
            if self.world_size % self.ranks_per_node != 0:
                raise TopologyError(
                    f"world_size({self.world_size}) is not a multiple of "
                    f"ranks_per_node({self.ranks_per_node}): with ranks_per_node every node "
                    "runs the same number of ranks (give node_of_rank for uneven nodes)"
                )
            return
        if not isinstance(nodes, tuple) or len(nodes) != self.world_size:
            raise TopologyError(
                f"node_of_rank must be a tuple of world_size({self.world_size}) node ids"
            )
        sizes = node_sizes_of(nodes)
        if max(sizes) != self.ranks_per_node:
            raise TopologyError(
                f"ranks_per_node({self.ranks_per_node}) must be the size of the largest node "
                f"in node_of_rank ({max(sizes)} ranks)"
            )

    def _check_sizes(self) -> None:
        product = self.ring_degree * self.ulysses_degree * self.dp_degree
        if product != self.world_size:
            raise TopologyError(
                f"ring({self.ring_degree}) * ulysses({self.ulysses_degree}) * "
                f"dp({self.dp_degree}) = {product} != world_size({self.world_size})"
            )

    def _check_ulysses_inside_nodes(self) -> None:
        groups = self._ulysses_progressions
        index = self._nodes.first_crossing(groups)
        if index is None:
            return
        members = groups.members(index)
        nodes = self._nodes.nodes_of(members)
        shown = (
            ", ".join(map(str, nodes))
            if nodes is not None
            else f"{self.node_of(members[0])} to {self.node_of(members[-1])}"
        )
        fits = self._fitting_ulysses(self.placement)
        best = max(fits)
        hint = (
            f"use ulysses_degree={best} (with ring_degree={self.sp_degree // best} for the "
            f"same sp size {self.sp_degree})"
        )
        other = ULYSSES_IN_NODE if self.placement == RING_IN_NODE else RING_IN_NODE
        if self.ulysses_degree in self._fitting_ulysses(other):
            hint += f", or placement {other!r}"
        raise TopologyError(
            f"Ulysses group {index} (ranks {_short_list(members)}) spans nodes {shown} with "
            f"{self.describe_nodes()}, ulysses({self.ulysses_degree}), ring({self.ring_degree}), "
            f"placement {self.placement!r}; the all-to-all would cross slow links. "
            f"Either {hint}, or pass allow_cross_node_ulysses=True"
        )

    def _fitting_ulysses(self, placement: str) -> list[int]:
        return fitting_ulysses_degrees(
            self.sp_degree,
            self.ranks_per_node,
            placement,
            self.world_size,
            node_of_rank=self.node_of_rank,
        )

    # ------------------------------------------------------------------ sizes and nodes
    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @cached_property
    def _nodes(self) -> _Nodes:
        return _Nodes(self.world_size, self.ranks_per_node, self.node_of_rank)

    @property
    def uniform_nodes(self) -> bool:
        """True when nodes are ``ranks_per_node`` consecutive ranks each (the default)."""
        return self.node_of_rank is None

    @property
    def num_nodes(self) -> int:
        if self.node_of_rank is None:
            return self.world_size // self.ranks_per_node
        return len(self.node_sizes)

    @cached_property
    def node_sizes(self) -> tuple[int, ...]:
        """Ranks on each node, by node id (not for uniform worlds above the list limit)."""
        if self.node_of_rank is None:
            _check_listable("node_sizes", self.world_size)
            return (self.ranks_per_node,) * self.num_nodes
        return node_sizes_of(self.node_of_rank)

    def describe_nodes(self) -> str:
        """``"2 nodes x 8 ranks"``, ``"2 nodes with 4 and 2 ranks"``, ..."""
        if self.node_of_rank is None:
            return describe_uniform_nodes(self.num_nodes, self.ranks_per_node)
        text = describe_node_shape(self.node_sizes)
        if len(set(self.node_sizes)) == 1:
            text += " (ranks interleaved across nodes)"
        return text

    # ------------------------------------------------------------------ one rank
    def rank_of(self, dp: int, ring: int, ulysses: int) -> int:
        """Global rank at coordinates ``(dp, ring, ulysses)``."""
        for name, value, size in (
            ("dp", dp, self.dp_degree),
            ("ring", ring, self.ring_degree),
            ("ulysses", ulysses, self.ulysses_degree),
        ):
            if not 0 <= value < size:
                raise IndexError(f"{name} coordinate {value} out of range [0, {size})")
        return _rank(self.placement, self.ring_degree, self.ulysses_degree, dp, ring, ulysses)

    def coords_of(self, rank: int) -> Coords:
        """``(dp, ring, ulysses)`` of a global rank (inverse of :meth:`rank_of`)."""
        self._check_rank(rank)
        r, u = self.ring_degree, self.ulysses_degree
        dp, inner = divmod(rank, r * u)
        if self.placement == ULYSSES_IN_NODE:
            ring, ulysses = divmod(inner, u)
        else:
            ulysses, ring = divmod(inner, r)
        return Coords(dp, ring, ulysses)

    def sp_rank_of(self, rank: int) -> int:
        c = self.coords_of(rank)
        return c.ring * self.ulysses_degree + c.ulysses

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return self._nodes.node_of(rank)

    def local_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        if self.node_of_rank is None:
            return rank % self.ranks_per_node
        return self._local_ranks[rank]

    @cached_property
    def _local_ranks(self) -> tuple[int, ...]:
        seen: dict[int, int] = {}
        local = []
        for node in self.node_of_rank:
            local.append(seen.get(node, 0))
            seen[node] = local[-1] + 1
        return tuple(local)

    def info(self, rank: int) -> RankInfo:
        c = self.coords_of(rank)
        return RankInfo(
            rank=rank,
            node=self.node_of(rank),
            local_rank=self.local_rank_of(rank),
            dp=c.dp,
            ring=c.ring,
            ulysses=c.ulysses,
            sp=c.ring * self.ulysses_degree + c.ulysses,
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range [0, {self.world_size})")

    # ------------------------------------------------------------------ one group, lazily
    @cached_property
    def _ulysses_progressions(self) -> _Progressions:
        return _ulysses_progressions(
            self.placement, self.world_size, self.ring_degree, self.ulysses_degree
        )

    @cached_property
    def _ring_progressions(self) -> _Progressions:
        return _ring_progressions(
            self.placement, self.world_size, self.ring_degree, self.ulysses_degree
        )

    def ulysses_group(self, index: int) -> range:
        """Ulysses group ``index = dp * r + ring``, ascending (= ulysses order)."""
        _check_index("Ulysses group", index, self.dp_degree * self.ring_degree)
        return self._ulysses_progressions.members(index)

    def ring_group(self, index: int) -> range:
        """Ring group ``index = dp * u + ulysses``, ascending (= ring order)."""
        _check_index("ring group", index, self.dp_degree * self.ulysses_degree)
        return self._ring_progressions.members(index)

    def sp_group(self, index: int) -> Sequence[int]:
        """The sp group of replica ``index`` (= dp), in sp_rank order."""
        _check_index("sp group", index, self.dp_degree)
        if self.placement == ULYSSES_IN_NODE or 1 in (self.ulysses_degree, self.ring_degree):
            start = index * self.sp_degree
            return range(start, start + self.sp_degree)
        return _SpOrder(self, index)

    def dp_group(self, index: int) -> range:
        """The dp group of sp rank ``index``, ascending (= dp order)."""
        _check_index("dp group", index, self.sp_degree)
        u = self.ulysses_degree
        first = self.rank_of(0, index // u, index % u)
        return range(first, self.world_size, self.sp_degree)

    # ------------------------------------------------------------------ all ranks (listed)
    @cached_property
    def ranks(self) -> list[RankInfo]:
        """:class:`RankInfo` of every rank, indexed by global rank."""
        _check_listable("RankMap.ranks", self.world_size)
        return [self.info(rank) for rank in range(self.world_size)]

    @cached_property
    def ulysses_groups(self) -> list[list[int]]:
        """``d * r`` groups of ``u`` ranks, indexed by ``dp * r + ring``."""
        _check_listable("RankMap.ulysses_groups", self.world_size)
        return [list(self.ulysses_group(i)) for i in range(self.dp_degree * self.ring_degree)]

    @cached_property
    def ring_groups(self) -> list[list[int]]:
        """``d * u`` groups of ``r`` ranks, indexed by ``dp * u + ulysses``."""
        _check_listable("RankMap.ring_groups", self.world_size)
        return [list(self.ring_group(i)) for i in range(self.dp_degree * self.ulysses_degree)]

    @cached_property
    def sp_groups(self) -> list[list[int]]:
        """``d`` groups of ``r * u`` ranks, indexed by dp, members in ``sp_rank`` order.

        Not ascending for ``"ring-in-node"`` with ``u > 1`` and ``r > 1``.
        """
        _check_listable("RankMap.sp_groups", self.world_size)
        return [list(self.sp_group(i)) for i in range(self.dp_degree)]

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        """``r * u`` groups of ``d`` ranks, indexed by ``sp_rank``."""
        _check_listable("RankMap.dp_groups", self.world_size)
        return [list(self.dp_group(i)) for i in range(self.sp_degree)]

    def mesh_list(self) -> list[list[list[int]]]:
        """Nested list ``mesh[dp][ring][ulysses] = global rank`` (shape ``(d, r, u)``).

        ``torch.tensor(rank_map.mesh_list())`` is the rank tensor of a DeviceMesh with
        axes ``("dp", "ring", "ulysses")``.
        """
        _check_listable("RankMap.mesh_list", self.world_size)
        return [
            [
                [self.rank_of(dp, ring, k) for k in range(self.ulysses_degree)]
                for ring in range(self.ring_degree)
            ]
            for dp in range(self.dp_degree)
        ]

    # ------------------------------------------------------------------ one rank's groups
    def ulysses_group_of(self, rank: int) -> list[int]:
        c = self.coords_of(rank)
        return list(self.ulysses_group(c.dp * self.ring_degree + c.ring))

    def ring_group_of(self, rank: int) -> list[int]:
        c = self.coords_of(rank)
        return list(self.ring_group(c.dp * self.ulysses_degree + c.ulysses))

    def sp_group_of(self, rank: int) -> list[int]:
        return list(self.sp_group(self.coords_of(rank).dp))

    def dp_group_of(self, rank: int) -> list[int]:
        return list(self.dp_group(self.sp_rank_of(rank)))

    # ------------------------------------------------------------------ node facts
    def cross_node_ulysses_count(self) -> int:
        """How many Ulysses groups have members on more than one node (closed-form)."""
        return self._nodes.crossing_count(self._ulysses_progressions)

    def cross_node_ulysses_groups(self) -> list[int]:
        """Indices of Ulysses groups whose members sit on more than one node."""
        _check_listable("RankMap.cross_node_ulysses_groups", self.world_size)
        groups = self._ulysses_progressions
        return [i for i in range(groups.num_groups) if self._nodes.crosses(groups.members(i))]

    def ring_groups_inside_nodes(self) -> bool:
        """True when every ring group stays on one node (all ring traffic intra-node)."""
        return self._nodes.first_crossing(self._ring_progressions) is None

    def describe(self) -> str:
        return (
            f"dp({self.dp_degree}) x ring({self.ring_degree}) x ulysses({self.ulysses_degree}) "
            f"= {self.world_size} ranks on {self.describe_nodes()}, "
            f"placement {self.placement!r}"
        )


def _check_index(what: str, index: int, size: int) -> None:
    if not 0 <= index < size:
        raise IndexError(f"{what} {index} out of range [0, {size})")


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
    world_size = sp_size if world_size is None else world_size
    nodes = _Nodes(
        world_size, ranks_per_node, None if node_of_rank is None else tuple(node_of_rank)
    )
    return [
        u
        for u in divisors(sp_size)
        if nodes.first_crossing(_ulysses_progressions(placement, world_size, sp_size // u, u))
        is None
    ]

"""Pure rank math: global ranks <-> (dp, ring, ulysses) coordinates, nodes and groups.

Nothing here touches ``torch.distributed``. A :class:`RankMap` of any world size up to
:data:`MAX_WORLD_SIZE` is validated and queried one rank or one group at a time without
memory proportional to the world; only the node checks of uniform nodes need a closed
form for that (in :mod:`usp.process_groups.nodes`). Explicit node lists (an observed
launch) and the methods that list every rank or group (up to :data:`MAX_LISTED_RANKS`
ranks) simply scan.

Conventions the rest of ``usp`` relies on:

- Coordinates ``(dp, ring, ulysses)`` with ``0 <= dp < d``, ``0 <= ring < r``,
  ``0 <= ulysses < u`` and ``d * r * u == world_size``; ``sp_rank = ring * u + ulysses``
  for both placements (a rank's tokens are chunk ``ring`` of the ring layout, split again
  by the Ulysses all-to-all).
- Nodes: by default as torchrun numbers them, ``node = rank // ranks_per_node``,
  ``local_rank = rank % ranks_per_node``. An observed launch (:mod:`.launch`) may give
  every rank's node (``node_of_rank``; uneven or interleaved nodes). Node ids follow each
  node's lowest rank; ``local_rank`` is a rank's position among its node's ranks.
- Placements: ``"ulysses-in-node"`` (default), ``rank = (dp * r + ring) * u + ulysses``:
  Ulysses groups are ``u`` contiguous ranks, ring members ``u`` apart.
  ``"ring-in-node"``, ``rank = (dp * u + ulysses) * r + ring``: ring groups are ``r``
  contiguous ranks, Ulysses members ``r`` apart.
- Member lists: Ulysses, ring and dp groups list members in coordinate order, which is
  ascending in global rank, so torch's group rank equals the coordinate. ``sp_groups[i]``
  lists members in ``sp_rank`` order, which for ``"ring-in-node"`` with ``u > 1`` is NOT
  ascending: the sp group's torch rank is then not ``sp_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from usp.errors import TopologyError  # noqa: F401 - re-exported here
from usp.process_groups.nodes import (  # noqa: F401 - the node math, re-exported here
    PLACEMENTS,
    RING_IN_NODE,
    ULYSSES_IN_NODE,
    check_nodes,
    crosses,
    crossing_count,
    describe_node_shape,
    describe_uniform_nodes,
    divisors,
    first_crossing,
    fitting_ulysses_degrees,
    node_sizes_of,
    ring_progressions,
    ulysses_progressions,
)

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


# ----------------------------------------------------------------------------- small helpers
def check_degree(name: str, value: object) -> int:
    """``value`` as an int >= 1, or a :class:`TopologyError` naming ``name`` (``bool`` is
    refused although it is an ``int``: ``ulysses_degree=True`` is a bug, not a 1)."""
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


def _check_index(what: str, index: int, size: int) -> None:
    if not 0 <= index < size:
        raise IndexError(f"{what} {index} out of range [0, {size})")


class _SpOrder(Sequence):
    """The members of one sp group in ``sp_rank`` order, computed on access (the
    ring-in-node sp group is no progression; a world of 2**31 ranks has no room for it)."""

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


# ----------------------------------------------------------------------------- the map
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
        uniform = len(set(sizes)) == 1 and nodes == tuple(x // rpn for x in range(len(nodes)))
        return cls(
            len(nodes),
            rpn,
            ulysses_degree,
            ring_degree,
            dp_degree,
            placement=placement,
            allow_cross_node_ulysses=allow_cross_node_ulysses,
            node_of_rank=None if uniform else nodes,
        )

    # ------------------------------------------------------------------ validation
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
        check_nodes(self.world_size, self.ranks_per_node, self.node_of_rank)
        product = self.ring_degree * self.ulysses_degree * self.dp_degree
        if product != self.world_size:
            raise TopologyError(
                f"ring({self.ring_degree}) * ulysses({self.ulysses_degree}) * "
                f"dp({self.dp_degree}) = {product} != world_size({self.world_size})"
            )
        if not self.allow_cross_node_ulysses:
            self._check_ulysses_inside_nodes()

    def _check_ulysses_inside_nodes(self) -> None:
        groups = self._ulysses
        index = first_crossing(groups, self.ranks_per_node, self.node_of_rank)
        if index is None:
            return
        members = groups.members(index)
        if len(members) <= _MAX_SCANNED_MEMBERS:
            shown = ", ".join(map(str, sorted({self.node_of(m) for m in members})))
        else:
            shown = f"{self.node_of(members[0])} to {self.node_of(members[-1])}"

        def fitting(placement: str) -> list[int]:
            n, nodes = self.ranks_per_node, self.node_of_rank
            return fitting_ulysses_degrees(
                self.sp_degree, n, placement, self.world_size, node_of_rank=nodes
            )

        best = max(fitting(self.placement))
        hint = (
            f"use ulysses_degree={best} (with ring_degree={self.sp_degree // best} for the "
            f"same sp size {self.sp_degree})"
        )
        other = ULYSSES_IN_NODE if self.placement == RING_IN_NODE else RING_IN_NODE
        if self.ulysses_degree in fitting(other):
            hint += f", or placement {other!r}"
        raise TopologyError(
            f"Ulysses group {index} (ranks {_short_list(members)}) spans nodes {shown} with "
            f"{self.describe_nodes()}, ulysses({self.ulysses_degree}), ring({self.ring_degree}), "
            f"placement {self.placement!r}; the all-to-all would cross slow links. "
            f"Either {hint}, or pass allow_cross_node_ulysses=True"
        )

    # ------------------------------------------------------------------ sizes and nodes
    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

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
        r, u = self.ring_degree, self.ulysses_degree
        for name, value, size in (
            ("dp", dp, self.dp_degree),
            ("ring", ring, r),
            ("ulysses", ulysses, u),
        ):
            if not 0 <= value < size:
                raise IndexError(f"{name} coordinate {value} out of range [0, {size})")
        if self.placement == ULYSSES_IN_NODE:
            return (dp * r + ring) * u + ulysses
        return (dp * u + ulysses) * r + ring

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
        if self.node_of_rank is None:
            return rank // self.ranks_per_node
        return self.node_of_rank[rank]

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
        sp = c.ring * self.ulysses_degree + c.ulysses
        return RankInfo(rank, self.node_of(rank), self.local_rank_of(rank), *c, sp)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range [0, {self.world_size})")

    # ------------------------------------------------------------------ one group, lazily
    @cached_property
    def _ulysses(self):
        r, u = self.ring_degree, self.ulysses_degree
        return ulysses_progressions(self.placement, self.world_size, r, u)

    @cached_property
    def _ring(self):
        r, u = self.ring_degree, self.ulysses_degree
        return ring_progressions(self.placement, self.world_size, r, u)

    def ulysses_group(self, index: int) -> range:
        """Ulysses group ``index = dp * r + ring``, ascending (= ulysses order)."""
        _check_index("Ulysses group", index, self.dp_degree * self.ring_degree)
        return self._ulysses.members(index)

    def ring_group(self, index: int) -> range:
        """Ring group ``index = dp * u + ulysses``, ascending (= ring order)."""
        _check_index("ring group", index, self.dp_degree * self.ulysses_degree)
        return self._ring.members(index)

    def sp_group(self, index: int) -> Sequence[int]:
        """The sp group of replica ``index`` (= dp), in sp_rank order."""
        _check_index("sp group", index, self.dp_degree)
        if self.placement == ULYSSES_IN_NODE or 1 in (self.ulysses_degree, self.ring_degree):
            return range(index * self.sp_degree, (index + 1) * self.sp_degree)
        return _SpOrder(self, index)

    def dp_group(self, index: int) -> range:
        """The dp group of sp rank ``index``, ascending (= dp order)."""
        _check_index("dp group", index, self.sp_degree)
        u = self.ulysses_degree
        return range(self.rank_of(0, index // u, index % u), self.world_size, self.sp_degree)

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

    # ------------------------------------------------------------------ all ranks (listed)
    def _listed(self, what: str, group, count: int) -> list[list[int]]:
        _check_listable(f"RankMap.{what}", self.world_size)
        return [list(group(i)) for i in range(count)]

    @cached_property
    def ranks(self) -> list[RankInfo]:
        """:class:`RankInfo` of every rank, indexed by global rank."""
        _check_listable("RankMap.ranks", self.world_size)
        return [self.info(rank) for rank in range(self.world_size)]

    @cached_property
    def ulysses_groups(self) -> list[list[int]]:
        """``d * r`` groups of ``u`` ranks, indexed by ``dp * r + ring``."""
        return self._listed("ulysses_groups", self.ulysses_group, self.dp_degree * self.ring_degree)

    @cached_property
    def ring_groups(self) -> list[list[int]]:
        """``d * u`` groups of ``r`` ranks, indexed by ``dp * u + ulysses``."""
        return self._listed("ring_groups", self.ring_group, self.dp_degree * self.ulysses_degree)

    @cached_property
    def sp_groups(self) -> list[list[int]]:
        """``d`` groups of ``r * u`` ranks, indexed by dp, members in ``sp_rank`` order
        (not ascending for ``"ring-in-node"`` with ``u > 1`` and ``r > 1``)."""
        return self._listed("sp_groups", self.sp_group, self.dp_degree)

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        """``r * u`` groups of ``d`` ranks, indexed by ``sp_rank``."""
        return self._listed("dp_groups", self.dp_group, self.sp_degree)

    def mesh_list(self) -> list[list[list[int]]]:
        """Nested list ``mesh[dp][ring][ulysses] = global rank`` (shape ``(d, r, u)``):
        ``torch.tensor(rank_map.mesh_list())`` is the rank tensor of a DeviceMesh with
        axes ``("dp", "ring", "ulysses")``."""
        _check_listable("RankMap.mesh_list", self.world_size)
        u, r = self.ulysses_degree, self.ring_degree
        return [
            [[self.rank_of(dp, ring, k) for k in range(u)] for ring in range(r)]
            for dp in range(self.dp_degree)
        ]

    # ------------------------------------------------------------------ node facts
    def cross_node_ulysses_count(self) -> int:
        """How many Ulysses groups have members on more than one node (closed-form)."""
        return crossing_count(self._ulysses, self.ranks_per_node, self.node_of_rank)

    def cross_node_ulysses_groups(self) -> list[int]:
        """Indices of Ulysses groups whose members sit on more than one node."""
        _check_listable("RankMap.cross_node_ulysses_groups", self.world_size)
        n, nodes, groups = self.ranks_per_node, self.node_of_rank, self._ulysses
        return [i for i in range(groups.num_groups) if crosses(groups.members(i), n, nodes)]

    def ring_groups_inside_nodes(self) -> bool:
        """True when every ring group stays on one node (all ring traffic intra-node)."""
        return first_crossing(self._ring, self.ranks_per_node, self.node_of_rank) is None

    def describe(self) -> str:
        return (
            f"dp({self.dp_degree}) x ring({self.ring_degree}) x ulysses({self.ulysses_degree}) "
            f"= {self.world_size} ranks on {self.describe_nodes()}, "
            f"placement {self.placement!r}"
        )

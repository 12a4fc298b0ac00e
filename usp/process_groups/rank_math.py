"""Pure rank math: global ranks <-> (dp, ring, ulysses) coordinates, nodes and groups.

Nothing here touches ``torch.distributed``; a :class:`RankMap` can be built and checked
for any world size (the CLI and the unit tests use worlds of up to 1024 ranks).

Conventions that the rest of ``usp`` relies on:

- Every rank has coordinates ``(dp, ring, ulysses)`` with ``0 <= dp < d``,
  ``0 <= ring < r`` and ``0 <= ulysses < u``; ``d * r * u == world_size``.
- ``sp_rank = ring * u + ulysses`` for both placements: the position of a rank inside
  its sequence-parallel replica. A rank's tokens are chunk ``ring`` of the ring layout,
  split again by the Ulysses all-to-all.
- Ranks are placed on nodes the way torchrun numbers them: ``node = rank //
  ranks_per_node`` and ``local_rank = rank % ranks_per_node``.
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

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

ULYSSES_IN_NODE = "ulysses-in-node"
RING_IN_NODE = "ring-in-node"
PLACEMENTS = (ULYSSES_IN_NODE, RING_IN_NODE)


class TopologyError(ValueError):
    """Degrees, world size, node size and placement do not fit together."""


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


def divisors(n: int) -> list[int]:
    """Ascending divisors of ``n >= 1``."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _rank(placement: str, r: int, u: int, dp: int, ring: int, ulysses: int) -> int:
    if placement == ULYSSES_IN_NODE:
        return (dp * r + ring) * u + ulysses
    return (dp * u + ulysses) * r + ring


def _ulysses_groups(placement: str, d: int, r: int, u: int) -> list[list[int]]:
    return [
        [_rank(placement, r, u, dp, ring, k) for k in range(u)]
        for dp in range(d)
        for ring in range(r)
    ]


def _first_cross_node_group(groups: list[list[int]], ranks_per_node: int):
    """``(index, members, nodes)`` of the first group spanning nodes, or None."""
    for index, members in enumerate(groups):
        nodes = sorted({m // ranks_per_node for m in members})
        if len(nodes) > 1:
            return index, members, nodes
    return None


def _short_list(values: list[int], limit: int = 8) -> str:
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} ranks)]"


@dataclass(frozen=True)
class RankMap:
    """The placement of ``world_size`` ranks on a ``dp x ring x ulysses`` grid.

    Validates in ``__post_init__``; every error is a :class:`TopologyError` whose message
    prints each factor and the target. See the module docstring for the conventions.
    """

    world_size: int
    ranks_per_node: int
    ulysses_degree: int
    ring_degree: int
    dp_degree: int
    placement: str = ULYSSES_IN_NODE
    allow_cross_node_ulysses: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node", "ulysses_degree", "ring_degree", "dp_degree"):
            check_degree(name, getattr(self, name))
        if self.placement not in PLACEMENTS:
            raise TopologyError(
                f"placement must be one of {', '.join(map(repr, PLACEMENTS))}, got {self.placement!r}"
            )
        if not isinstance(self.allow_cross_node_ulysses, bool):
            raise TopologyError(
                f"allow_cross_node_ulysses must be a bool, got {self.allow_cross_node_ulysses!r}"
            )
        self._check_sizes()
        if not self.allow_cross_node_ulysses:
            self._check_ulysses_inside_nodes()

    # ------------------------------------------------------------------ validation
    def _check_sizes(self) -> None:
        w, n = self.world_size, self.ranks_per_node
        if w % n != 0:
            raise TopologyError(
                f"world_size({w}) is not a multiple of ranks_per_node({n}): "
                "every node must run the same number of ranks"
            )
        product = self.ring_degree * self.ulysses_degree * self.dp_degree
        if product != w:
            raise TopologyError(
                f"ring({self.ring_degree}) * ulysses({self.ulysses_degree}) * "
                f"dp({self.dp_degree}) = {product} != world_size({w})"
            )

    def _check_ulysses_inside_nodes(self) -> None:
        bad = _first_cross_node_group(self.ulysses_groups, self.ranks_per_node)
        if bad is None:
            return
        index, members, nodes = bad
        fits = fitting_ulysses_degrees(
            self.sp_degree, self.ranks_per_node, self.placement, self.world_size
        )
        best = max(fits)
        hint = (
            f"use ulysses_degree={best} (with ring_degree={self.sp_degree // best} for the "
            f"same sp size {self.sp_degree})"
        )
        other = ULYSSES_IN_NODE if self.placement == RING_IN_NODE else RING_IN_NODE
        if self.ulysses_degree in fitting_ulysses_degrees(
            self.sp_degree, self.ranks_per_node, other, self.world_size
        ):
            hint += f", or placement {other!r}"
        raise TopologyError(
            f"Ulysses group {index} (ranks {_short_list(members)}) spans nodes "
            f"{', '.join(map(str, nodes))} with ranks_per_node({self.ranks_per_node}), "
            f"ulysses({self.ulysses_degree}), ring({self.ring_degree}), placement {self.placement!r}; "
            f"the all-to-all would cross slow links. Either {hint}, "
            "or pass allow_cross_node_ulysses=True"
        )

    # ------------------------------------------------------------------ sizes
    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

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
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def info(self, rank: int) -> RankInfo:
        c = self.coords_of(rank)
        return RankInfo(
            rank=rank,
            node=rank // self.ranks_per_node,
            local_rank=rank % self.ranks_per_node,
            dp=c.dp,
            ring=c.ring,
            ulysses=c.ulysses,
            sp=c.ring * self.ulysses_degree + c.ulysses,
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range [0, {self.world_size})")

    # ------------------------------------------------------------------ all ranks
    @cached_property
    def ranks(self) -> list[RankInfo]:
        """:class:`RankInfo` of every rank, indexed by global rank."""
        return [self.info(rank) for rank in range(self.world_size)]

    @cached_property
    def ulysses_groups(self) -> list[list[int]]:
        """``d * r`` groups of ``u`` ranks, indexed by ``dp * r + ring``."""
        return _ulysses_groups(
            self.placement, self.dp_degree, self.ring_degree, self.ulysses_degree
        )

    @cached_property
    def ring_groups(self) -> list[list[int]]:
        """``d * u`` groups of ``r`` ranks, indexed by ``dp * u + ulysses``."""
        return [
            [self.rank_of(dp, ring, k) for ring in range(self.ring_degree)]
            for dp in range(self.dp_degree)
            for k in range(self.ulysses_degree)
        ]

    @cached_property
    def sp_groups(self) -> list[list[int]]:
        """``d`` groups of ``r * u`` ranks, indexed by dp, members in ``sp_rank`` order.

        Not ascending for ``"ring-in-node"`` with ``u > 1`` and ``r > 1``.
        """
        u = self.ulysses_degree
        return [
            [self.rank_of(dp, sp // u, sp % u) for sp in range(self.sp_degree)]
            for dp in range(self.dp_degree)
        ]

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        """``r * u`` groups of ``d`` ranks, indexed by ``sp_rank``."""
        u = self.ulysses_degree
        return [
            [self.rank_of(dp, sp // u, sp % u) for dp in range(self.dp_degree)]
            for sp in range(self.sp_degree)
        ]

    def mesh_list(self) -> list[list[list[int]]]:
        """Nested list ``mesh[dp][ring][ulysses] = global rank`` (shape ``(d, r, u)``).

        ``torch.tensor(rank_map.mesh_list())`` is the rank tensor of a DeviceMesh with
        axes ``("dp", "ring", "ulysses")``.
        """
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
        return self.ulysses_groups[c.dp * self.ring_degree + c.ring]

    def ring_group_of(self, rank: int) -> list[int]:
        c = self.coords_of(rank)
        return self.ring_groups[c.dp * self.ulysses_degree + c.ulysses]

    def sp_group_of(self, rank: int) -> list[int]:
        return self.sp_groups[self.coords_of(rank).dp]

    def dp_group_of(self, rank: int) -> list[int]:
        return self.dp_groups[self.sp_rank_of(rank)]

    # ------------------------------------------------------------------ node facts
    def cross_node_ulysses_groups(self) -> list[int]:
        """Indices of Ulysses groups whose members sit on more than one node."""
        n = self.ranks_per_node
        return [
            i for i, members in enumerate(self.ulysses_groups) if len({m // n for m in members}) > 1
        ]

    def ring_groups_inside_nodes(self) -> bool:
        """True when every ring group stays on one node (all ring traffic intra-node)."""
        n = self.ranks_per_node
        return all(len({m // n for m in members}) == 1 for members in self.ring_groups)

    def describe(self) -> str:
        return (
            f"dp({self.dp_degree}) x ring({self.ring_degree}) x ulysses({self.ulysses_degree}) "
            f"= {self.world_size} ranks on {self.num_nodes} node(s) of {self.ranks_per_node}, "
            f"placement {self.placement!r}"
        )


def fitting_ulysses_degrees(
    sp_size: int,
    ranks_per_node: int,
    placement: str = ULYSSES_IN_NODE,
    world_size: int | None = None,
) -> list[int]:
    """Ulysses degrees ``u`` dividing ``sp_size`` whose groups all stay inside one node.

    Checked on the real layout (``world_size`` defaults to ``sp_size``), so it is right
    for both placements. Always contains 1.
    """
    world_size = sp_size if world_size is None else world_size
    d = world_size // sp_size
    fits = []
    for u in divisors(sp_size):
        groups = _ulysses_groups(placement, d, sp_size // u, u)
        if _first_cross_node_group(groups, ranks_per_node) is None:
            fits.append(u)
    return fits

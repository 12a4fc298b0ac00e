"""Pure rank math: coordinates, nodes, groups and validation at world sizes up to 1024."""

import itertools

import pytest

from usp.process_groups.rank_math import (
    MAX_LISTED_RANKS,
    MAX_WORLD_SIZE,
    PLACEMENTS,
    RING_IN_NODE,
    ULYSSES_IN_NODE,
    RankMap,
    TopologyError,
    describe_node_shape,
    divisors,
    fitting_ulysses_degrees,
    node_sizes_of,
)

# (world_size, ranks_per_node, ulysses, ring, dp, placement)
LAYOUTS = [
    (1, 1, 1, 1, 1, ULYSSES_IN_NODE),
    (4, 4, 2, 2, 1, ULYSSES_IN_NODE),
    (4, 4, 2, 2, 1, RING_IN_NODE),
    (8, 4, 4, 2, 1, ULYSSES_IN_NODE),
    (16, 8, 8, 2, 1, ULYSSES_IN_NODE),
    (16, 8, 2, 4, 2, RING_IN_NODE),
    (64, 8, 8, 4, 2, ULYSSES_IN_NODE),
    (96, 8, 4, 6, 4, ULYSSES_IN_NODE),
    (128, 16, 4, 4, 8, RING_IN_NODE),
    (1024, 8, 8, 16, 8, ULYSSES_IN_NODE),
    (1024, 8, 4, 32, 8, ULYSSES_IN_NODE),
    (1024, 16, 4, 4, 64, RING_IN_NODE),
    (1024, 8, 1, 1024, 1, RING_IN_NODE),
    (1024, 1024, 1024, 1, 1, ULYSSES_IN_NODE),
]


def make(w, n, u, r, d, placement, **kw):
    return RankMap(w, n, u, r, d, placement=placement, **kw)


def _partition_check(groups, world_size, size):
    """Every rank in exactly one group, every group of the right size."""
    assert all(len(g) == size for g in groups)
    flat = sorted(itertools.chain.from_iterable(groups))
    assert flat == list(range(world_size))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_partition_the_world(layout):
    m = make(*layout)
    w, _, u, r, d, _ = layout
    _partition_check(m.ulysses_groups, w, u)
    _partition_check(m.ring_groups, w, r)
    _partition_check(m.sp_groups, w, u * r)
    _partition_check(m.dp_groups, w, d)
    assert (len(m.ulysses_groups), len(m.ring_groups), len(m.sp_groups), len(m.dp_groups)) == (
        d * r,
        d * u,
        d,
        u * r,
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coordinates_round_trip_and_match_formula(layout):
    m = make(*layout)
    w, n, u, r, d, placement = layout
    seen = set()
    for rank in range(w):
        c = m.coords_of(rank)
        assert m.rank_of(*c) == rank
        seen.add(tuple(c))
        expected = (
            (c.dp * r + c.ring) * u + c.ulysses
            if placement == ULYSSES_IN_NODE
            else (c.dp * u + c.ulysses) * r + c.ring
        )
        assert rank == expected
        assert m.sp_rank_of(rank) == c.ring * u + c.ulysses
        assert (m.node_of(rank), m.local_rank_of(rank)) == divmod(rank, n)
        assert m.ranks[rank] == (
            rank,
            rank // n,
            rank % n,
            c.dp,
            c.ring,
            c.ulysses,
            c.ring * u + c.ulysses,
        )
    assert len(seen) == w


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_group_member_orders(layout):
    """Ulysses/ring/dp groups ascend in coordinate order; sp groups follow sp_rank. Every
    rank's four groups (``*_group_of``) are checked; what holds for a group's members
    whichever member asked (they share the coordinate the group is named by, a Ulysses
    group stays on one node) is checked once per distinct group, from every member's
    coordinates (``coords_of`` of each rank, computed once): O(world) at 1024 ranks."""
    m = make(*layout)
    w, n, u, r, d, _ = layout
    coords = [m.coords_of(x) for x in range(w)]
    sp_ranks = [m.sp_rank_of(x) for x in range(w)]
    checked = set()  # (kind, members) already checked member by member

    def once(kind, group, same):
        """``same(coords of x)`` equal for every member x of ``group``, once per group."""
        key = (kind, tuple(group))
        if key not in checked:
            checked.add(key)
            assert all(0 <= x < w for x in group), (kind, group)  # (coords_of's range)
            assert len({same(x) for x in group}) == 1, (kind, group)

    for rank in range(w):
        c = coords[rank]
        ug, rg, sg, dg = (
            m.ulysses_group_of(rank),
            m.ring_group_of(rank),
            m.sp_group_of(rank),
            m.dp_group_of(rank),
        )
        assert ug == sorted(ug) and ug.index(rank) == c.ulysses
        assert rg == sorted(rg) and rg.index(rank) == c.ring
        assert dg == sorted(dg) and dg.index(rank) == c.dp
        assert sg.index(rank) == sp_ranks[rank]
        once("sp", sg, lambda x: coords[x].dp)
        once("ulysses", ug, lambda x: coords[x][:2])  # same dp and ring
        once("ring", rg, lambda x: (coords[x].ulysses, coords[x].dp))
        once("dp", dg, lambda x: sp_ranks[x])
        # Ulysses groups stay inside a node (validation is on by default).
        once("node", ug, lambda x: x // n)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mesh_list_is_indexed_by_coordinates(layout):
    m = make(*layout)
    w, _, u, r, d, _ = layout
    mesh = m.mesh_list()
    assert (len(mesh), len(mesh[0]), len(mesh[0][0])) == (d, r, u)
    for dp, ring, k in itertools.product(range(d), range(r), range(u)):
        assert mesh[dp][ring][k] == m.rank_of(dp, ring, k)


def test_concrete_layouts():
    m = RankMap(16, 8, 8, 2, 1)
    assert m.ulysses_groups == [list(range(8)), list(range(8, 16))]
    assert m.ring_groups[:3] == [[0, 8], [1, 9], [2, 10]]
    assert m.sp_groups == [list(range(16))]
    m = RankMap(16, 8, 2, 4, 2, placement=RING_IN_NODE)
    assert m.ulysses_groups[:2] == [[0, 4], [1, 5]]
    assert m.ring_groups[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # sp_rank = ring * u + ulysses: NOT ascending for ring-in-node.
    assert m.sp_groups[0] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert m.dp_groups[:2] == [[0, 8], [4, 12]]
    assert m.mesh_list()[1] == [[8, 12], [9, 13], [10, 14], [11, 15]]
    assert m.ring_groups_inside_nodes()


def test_large_world_is_fast():
    import time

    start = time.perf_counter()
    for placement in (ULYSSES_IN_NODE, RING_IN_NODE):
        m = RankMap(1024, 16, 4, 16, 16, placement=placement, allow_cross_node_ulysses=True)
        _ = m.ranks, m.ulysses_groups, m.ring_groups, m.sp_groups, m.dp_groups, m.mesh_list()
    assert time.perf_counter() - start < 2.0


# ----------------------------------------------------------------------------- validation
def _error(*args, **kw) -> str:
    with pytest.raises(TopologyError) as info:
        RankMap(*args, **kw)
    return str(info.value)


def test_product_mismatch_prints_every_factor():
    assert _error(16, 8, 4, 4, 2) == "ring(4) * ulysses(4) * dp(2) = 32 != world_size(16)"
    assert "ring(3) * ulysses(2) * dp(1) = 6 != world_size(8)" in _error(8, 8, 2, 3, 1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("world_size", 0),
        ("ranks_per_node", -1),
        ("ulysses_degree", 0),
        ("ring_degree", 2.0),
        ("dp_degree", True),
        ("ulysses_degree", "8"),
    ],
)
def test_bad_degree_names_the_argument(field, value):
    kwargs = dict(world_size=8, ranks_per_node=8, ulysses_degree=2, ring_degree=2, dp_degree=2)
    kwargs[field] = value
    message = _error(**kwargs)
    assert message.startswith(f"{field} must be an integer >= 1, got ")
    assert repr(value) in message or str(value) in message


def test_world_not_multiple_of_node():
    message = _error(12, 8, 4, 3, 1)
    assert "world_size(12) is not a multiple of ranks_per_node(8)" in message


def test_unknown_placement():
    assert "placement must be one of 'ulysses-in-node', 'ring-in-node', got 'nodes'" in _error(
        8, 8, 2, 2, 2, placement="nodes"
    )


def test_cross_node_ulysses_is_an_error_naming_group_and_nodes():
    message = _error(16, 8, 16, 1, 1)
    assert "Ulysses group 0" in message
    assert "spans nodes 0, 1" in message
    assert "ulysses_degree=8" in message and "ring_degree=2" in message
    assert "allow_cross_node_ulysses=True" in message


def test_ulysses_not_dividing_node_names_the_first_crossing_group():
    # u=3 with 4 ranks per node: group 0 = [0,1,2] fits, group 1 = [3,4,5] crosses.
    message = _error(12, 4, 3, 4, 1)
    assert "Ulysses group 1 (ranks [3, 4, 5]) spans nodes 0, 1" in message
    assert "ulysses_degree=4 (with ring_degree=3" in message


def test_ring_in_node_allows_cross_node_ring_but_not_cross_node_ulysses():
    m = RankMap(16, 4, 2, 8, 1, placement=RING_IN_NODE, allow_cross_node_ulysses=True)
    assert m.cross_node_ulysses_groups() == list(range(8))
    # The ring spans nodes (8 contiguous ranks, 4 per node): fine.
    ok = RankMap(16, 4, 2, 2, 4, placement=RING_IN_NODE)
    assert not ok.cross_node_ulysses_groups()
    assert RankMap(16, 4, 1, 8, 2, placement=RING_IN_NODE).ring_groups[0] == list(range(8))
    message = _error(16, 8, 4, 4, 1, placement=RING_IN_NODE)
    assert "Ulysses group 0 (ranks [0, 4, 8, 12]) spans nodes 0, 1" in message
    assert "placement 'ulysses-in-node'" in message  # u=4 would fit with the other placement


def test_allow_cross_node_ulysses_flag():
    m = RankMap(16, 8, 16, 1, 1, allow_cross_node_ulysses=True)
    assert m.cross_node_ulysses_groups() == [0]
    assert "allow_cross_node_ulysses must be a bool" in _error(
        16, 8, 8, 2, 1, allow_cross_node_ulysses=1
    )


def test_out_of_range_coordinates():
    m = RankMap(8, 8, 2, 2, 2)
    with pytest.raises(IndexError, match="ring coordinate 2 out of range"):
        m.rank_of(0, 2, 0)
    with pytest.raises(IndexError, match="rank 8 out of range"):
        m.coords_of(8)


@pytest.mark.parametrize(
    "sp, rpn, placement, world, expected",
    [
        (16, 8, ULYSSES_IN_NODE, 16, [1, 2, 4, 8]),
        (16, 8, RING_IN_NODE, 16, [1]),
        (16, 32, RING_IN_NODE, 64, [1, 2, 4, 8, 16]),
        (12, 4, ULYSSES_IN_NODE, 12, [1, 2, 4]),
    ],
)
def test_fitting_ulysses_degrees(sp, rpn, placement, world, expected):
    assert fitting_ulysses_degrees(sp, rpn, placement, world) == expected


# ----------------------------------------------------------------------------- closed-form node checks
def _brute_groups(placement, w, u, r, kind):
    """Ulysses or ring groups straight from the rank formula, indexed as documented."""
    d = w // (u * r)

    def rank(dp, ring, k):
        return (dp * r + ring) * u + k if placement == ULYSSES_IN_NODE else (dp * u + k) * r + ring

    if kind == "ulysses":
        return [[rank(dp, ring, k) for k in range(u)] for dp in range(d) for ring in range(r)]
    return [[rank(dp, ring, k) for ring in range(r)] for dp in range(d) for k in range(u)]


def _all_grids(max_world):
    for w in range(1, max_world + 1):
        for n in divisors(w):
            for u in divisors(w):
                for r in divisors(w // u):
                    for placement in PLACEMENTS:
                        yield w, n, u, r, placement


def test_closed_form_node_checks_match_brute_force():
    """Validation, crossing counts, ring locality and fitting degrees are computed without
    listing groups; check them against the listed groups on every small grid."""
    checked = 0
    for w, n, u, r, placement in _all_grids(24):
        ulysses = _brute_groups(placement, w, u, r, "ulysses")
        ring = _brute_groups(placement, w, u, r, "ring")
        crossing = [i for i, g in enumerate(ulysses) if len({m // n for m in g}) > 1]
        m = RankMap(w, n, u, r, w // (u * r), placement=placement, allow_cross_node_ulysses=True)
        assert m.ulysses_groups == ulysses and m.ring_groups == ring
        assert m.cross_node_ulysses_count() == len(crossing)
        assert m.cross_node_ulysses_groups() == crossing
        assert m.ring_groups_inside_nodes() == all(len({x // n for x in g}) == 1 for g in ring)
        if crossing:
            with pytest.raises(TopologyError, match=rf"^Ulysses group {crossing[0]} \("):
                RankMap(w, n, u, r, w // (u * r), placement=placement)
        fits = [
            k
            for k in divisors(u * r)
            if all(
                len({x // n for x in g}) == 1
                for g in _brute_groups(placement, w, k, u * r // k, "ulysses")
            )
        ]
        assert fitting_ulysses_degrees(u * r, n, placement, w) == fits
        checked += 1
    assert checked > 1000


def test_huge_worlds_need_no_memory_proportional_to_them():
    import time

    start = time.perf_counter()
    w = 2**30
    m = RankMap(w, 8, 8, 2**27, 1)  # validated in closed form
    assert m.info(w - 1) == (w - 1, w // 8 - 1, 7, 0, 2**27 - 1, 7, w - 1)
    assert m.ulysses_group(5) == range(40, 48)
    assert m.ring_group(3) == range(3, w, 8)
    assert len(m.sp_group(0)) == w and m.dp_group(7) == range(7, w, w)
    crossing = RankMap(w, 8, 16, 2**26, 1, allow_cross_node_ulysses=True)
    assert crossing.cross_node_ulysses_count() == 2**26
    strided = RankMap(w, 64, 4, 2**28, 1, placement=RING_IN_NODE, allow_cross_node_ulysses=True)
    assert strided.cross_node_ulysses_count() == 2**28
    assert fitting_ulysses_degrees(w, 8, ULYSSES_IN_NODE, w) == [1, 2, 4, 8]
    with pytest.raises(TopologyError, match="lists all 1073741824 ranks, more than 1048576"):
        _ = m.ranks
    with pytest.raises(TopologyError, match=r"RankMap.mesh_list lists all"):
        m.mesh_list()
    assert time.perf_counter() - start < 1.0
    assert MAX_LISTED_RANKS == 2**20


def test_world_larger_than_torch_can_launch():
    with pytest.raises(TopologyError) as info:
        RankMap(MAX_WORLD_SIZE + 1, 1, 1, MAX_WORLD_SIZE + 1, 1)
    assert str(info.value) == (
        "world_size(2147483648) exceeds the largest world torch.distributed can launch "
        "(2147483647 = 2**31 - 1 ranks)"
    )


# ----------------------------------------------------------------------------- observed nodes
def test_from_nodes_canonical_form():
    # uniform and contiguous: the same RankMap as ranks_per_node gives
    assert RankMap.from_nodes([0, 0, 1, 1], 2, 2, 1) == RankMap(4, 2, 2, 2, 1)
    assert RankMap.from_nodes([0, 0, 1, 1], 2, 2, 1).uniform_nodes
    interleaved = RankMap.from_nodes([0, 1, 0, 1], 2, 2, 1, placement=RING_IN_NODE)
    assert interleaved.node_of_rank == (0, 1, 0, 1) and not interleaved.uniform_nodes
    assert [interleaved.node_of(x) for x in range(4)] == [0, 1, 0, 1]
    assert [interleaved.local_rank_of(x) for x in range(4)] == [0, 0, 1, 1]
    assert interleaved.ulysses_groups == [[0, 2], [1, 3]]  # each inside one node
    assert interleaved.describe_nodes() == "2 nodes x 2 ranks (ranks interleaved across nodes)"
    assert "on 2 nodes x 2 ranks (ranks interleaved" in interleaved.describe()


def test_nodes_of_different_sizes():
    m = RankMap.from_nodes([0, 0, 0, 0, 1, 1], 2, 3, 1)
    assert m.ranks_per_node == 4 and m.node_sizes == (4, 2) and m.num_nodes == 2
    assert [m.info(x)[1:3] for x in range(6)] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert m.describe_nodes() == "2 nodes with 4 and 2 ranks"
    assert m.cross_node_ulysses_count() == 0 and not m.ring_groups_inside_nodes()
    with pytest.raises(TopologyError) as info:
        RankMap.from_nodes([0, 0, 0, 1, 1, 1, 1, 1], 2, 4, 1)
    assert str(info.value).startswith(
        "Ulysses group 1 (ranks [2, 3]) spans nodes 0, 1 with 2 nodes with 3 and 5 ranks"
    )
    assert "use ulysses_degree=1 (with ring_degree=8" in str(info.value)
    assert fitting_ulysses_degrees(8, 5, node_of_rank=[0, 0, 0, 1, 1, 1, 1, 1]) == [1]
    assert fitting_ulysses_degrees(6, 4, node_of_rank=[0, 0, 0, 0, 1, 1]) == [1, 2]


@pytest.mark.parametrize(
    "nodes, kwargs, message",
    [
        ([1, 1, 0, 0], {}, "node_of_rank[0] = 1: node ids must be 0, 1, ... in the order of"),
        ([0, 2, 1, 1], {}, "node_of_rank[1] = 2: node ids must be 0, 1, ..."),
        ([0, -1, 0, 0], {}, "node_of_rank[1] = -1 is not a node id >= 0"),
        ([0, True, 0, 0], {}, "node_of_rank[1] = True is not a node id >= 0"),
        ((), {}, "node_of_rank is empty"),
    ],
)
def test_bad_node_lists(nodes, kwargs, message):
    with pytest.raises(TopologyError) as info:
        node_sizes_of(nodes)
    assert str(info.value).startswith(message)


def test_node_list_must_fit_the_other_fields():
    with pytest.raises(TopologyError, match=r"node_of_rank must be a tuple of world_size\(4\)"):
        RankMap(4, 2, 2, 2, 1, node_of_rank=(0, 0, 1))
    with pytest.raises(TopologyError, match=r"ranks_per_node\(2\) must be the size of the larg"):
        RankMap(4, 2, 1, 4, 1, node_of_rank=(0, 0, 0, 1))


def test_describe_node_shape():
    assert describe_node_shape([4]) == "1 node x 4 ranks"
    assert describe_node_shape([1, 1]) == "2 nodes x 1 rank"
    assert describe_node_shape([4, 2, 2]) == "3 nodes with 4, 2 and 2 ranks"
    assert describe_node_shape([1] * 9 + [2]) == (
        "10 nodes with 1, 1, 1, 1, 1, 1, 1, 1 and ... (2 more) ranks"
    )

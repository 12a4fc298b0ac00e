"""Pure rank math: coordinates, nodes, groups and validation at world sizes up to 1024."""

import itertools

import pytest

from usp.process_groups.rank_math import (
    RING_IN_NODE,
    ULYSSES_IN_NODE,
    RankMap,
    TopologyError,
    fitting_ulysses_degrees,
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
    """Ulysses/ring/dp groups ascend in coordinate order; sp groups follow sp_rank."""
    m = make(*layout)
    w, n, u, r, d, _ = layout
    for rank in range(w):
        c = m.coords_of(rank)
        ug, rg, sg, dg = (
            m.ulysses_group_of(rank),
            m.ring_group_of(rank),
            m.sp_group_of(rank),
            m.dp_group_of(rank),
        )
        assert ug == sorted(ug) and ug.index(rank) == c.ulysses
        assert rg == sorted(rg) and rg.index(rank) == c.ring
        assert dg == sorted(dg) and dg.index(rank) == c.dp
        assert sg.index(rank) == m.sp_rank_of(rank)
        assert all(m.coords_of(x).dp == c.dp for x in sg)
        assert all(m.coords_of(x)[:2] == c[:2] for x in ug)  # same dp and ring
        assert all(m.coords_of(x).ulysses == c.ulysses and m.coords_of(x).dp == c.dp for x in rg)
        assert all(m.sp_rank_of(x) == m.sp_rank_of(rank) for x in dg)
        # Ulysses groups stay inside a node (validation is on by default).
        assert len({x // n for x in ug}) == 1


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

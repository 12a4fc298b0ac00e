"""Which (ulysses, ring) degrees the head counts allow, and KV head replication."""

import pytest

from usp.process_groups.degrees import (
    HeadLayoutError,
    describe_valid_pairs,
    format_pairs,
    kv_replication,
    suggest_degrees,
    valid_degree_pairs,
)


@pytest.mark.parametrize(
    "heads, kv_heads, u, expected",
    [
        (32, 8, 1, 1),
        (32, 8, 8, 1),  # Hkv % u == 0
        (32, 8, 4, 1),
        (32, 8, 16, 2),  # Llama-3-8B at u=16: each KV head twice
        (32, 8, 32, 4),
        (24, 6, 4, 2),  # lcm(6, 4) = 12
        (12, 4, 6, 3),  # lcm(4, 6) = 12
        (64, 8, 8, 1),
        (8, 8, 8, 1),  # multi-head attention
        (16, 1, 16, 16),  # multi-query attention
    ],
)
def test_kv_replication(heads, kv_heads, u, expected):
    assert kv_replication(heads, kv_heads, u) == expected


def _gqa_layout_holds(heads, kv_heads, u):
    """Brute force: after replication every Ulysses rank holds exactly the KV heads its
    query heads use (query head h -> expanded KV head h // (H / Hkv'))."""
    rep = kv_replication(heads, kv_heads, u)
    expanded = kv_heads * rep
    if expanded % u:
        return False
    group, expanded_group = heads // kv_heads, heads // expanded
    # Expanded head j is original head j // rep: the GQA mapping must be unchanged.
    if any(h // group != (h // expanded_group) // rep for h in range(heads)):
        return False
    q_per_rank, kv_per_rank = heads // u, expanded // u
    for rank in range(u):
        needed = {h // expanded_group for h in range(rank * q_per_rank, (rank + 1) * q_per_rank)}
        held = set(range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
        if needed != held:
            return False
    return True


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (24, 6), (64, 8), (12, 4), (48, 3)])
def test_replication_gives_every_rank_exactly_its_kv_heads(heads, kv_heads):
    for u in range(1, heads + 1):
        if heads % u == 0:
            assert _gqa_layout_holds(heads, kv_heads, u), (heads, kv_heads, u)


def test_heads_not_divisible_by_ulysses():
    with pytest.raises(HeadLayoutError, match=r"num_heads\(32\) is not divisible by ulysses\(3\)"):
        kv_replication(32, 8, 3)
    with pytest.raises(HeadLayoutError, match=r"num_heads\(24\) is not divisible by ulysses\(16\)"):
        kv_replication(24, 6, 16)


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(
        HeadLayoutError, match=r"num_heads\(32\) is not a multiple of num_kv_heads\(6\)"
    ):
        kv_replication(32, 6, 2)


@pytest.mark.parametrize("args", [(0, 1, 1), (8, True, 1), (8, 2, 0), (8, 2, 2.0)])
def test_bad_integers(args):
    with pytest.raises(HeadLayoutError, match="must be an integer >= 1"):
        kv_replication(*args)


def test_valid_pairs_llama3_8b():
    assert valid_degree_pairs(32, 8, 16, ranks_per_node=8) == [(1, 16), (2, 8), (4, 4), (8, 2)]
    # Without a node limit u=16 is allowed (with KV replication).
    assert valid_degree_pairs(32, 8, 16) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]


def test_valid_pairs_filters_heads_and_node():
    # 24 heads: u in {1,2,3,4,6,8,12,24} ∩ divisors(48) that divide 24 heads.
    assert valid_degree_pairs(24, 6, 48) == [
        (1, 48),
        (2, 24),
        (3, 16),
        (4, 12),
        (6, 8),
        (8, 6),
        (12, 4),
        (24, 2),
    ]
    assert valid_degree_pairs(24, 6, 48, ranks_per_node=8) == [(1, 48), (2, 24), (4, 12), (8, 6)]
    assert valid_degree_pairs(None, None, 12, ranks_per_node=4) == [(1, 12), (2, 6), (4, 3)]
    with pytest.raises(HeadLayoutError, match="both num_heads and num_kv_heads"):
        valid_degree_pairs(32, None, 8)
    with pytest.raises(HeadLayoutError, match="not a multiple of num_kv_heads"):
        valid_degree_pairs(30, 8, 8)


@pytest.mark.parametrize(
    "heads, kv, sp, rpn, expected",
    [
        (32, 8, 16, 8, (8, 2)),
        (64, 8, 64, 8, (8, 8)),
        (24, 6, 48, 16, (8, 6)),  # 16 does not divide 24 heads
        (12, 4, 16, 8, (4, 4)),  # 8 does not divide 12 heads
        (32, 8, 16, None, (16, 1)),
        (None, None, 16, 4, (4, 4)),
        (7, 7, 16, 8, (1, 16)),
    ],
)
def test_suggest_degrees(heads, kv, sp, rpn, expected):
    assert suggest_degrees(heads, kv, sp, rpn) == expected


def test_suggest_degrees_error_for_impossible_heads():
    with pytest.raises(
        HeadLayoutError, match=r"num_heads\(10\) is not a multiple of num_kv_heads\(4\)"
    ):
        suggest_degrees(10, 4, 8, 8)


def test_messages():
    assert format_pairs([(1, 16), (2, 8)]) == "(1, 16), (2, 8)"
    assert format_pairs([]) == "none"
    assert describe_valid_pairs(32, 8, 16, 8) == (
        "valid (ulysses, ring) pairs for sp_size=16 with 32 heads / 8 KV heads and 8 ranks per node: "
        "(1, 16), (2, 8), (4, 4), (8, 2)"
    )
    assert (
        describe_valid_pairs(None, None, 4)
        == "valid (ulysses, ring) pairs for sp_size=4: (1, 4), (2, 2), (4, 1)"
    )

"""Topology on real gloo process groups: every group holds exactly the expected ranks.

Each case runs one short body on all ranks; topologies are cached per worker
(``worker_cached``) because creating process groups in every test leaks sockets.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import worker_cached

from usp.comm.stats import CommStats
from usp.config import ConfigError, build_topology_from_config
from usp.process_groups.rank_math import RING_IN_NODE, ULYSSES_IN_NODE, RankMap, TopologyError
from usp.process_groups.topology import build_topology, default_ranks_per_node

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"

# (world_size, ulysses, ring, dp, ranks_per_node, placement)
CASES = [
    (4, 2, 2, 1, 4, ULYSSES_IN_NODE),
    (4, 2, 2, 1, 4, RING_IN_NODE),
    (4, 2, 1, 2, 2, ULYSSES_IN_NODE),
    (4, 1, 4, 1, 2, ULYSSES_IN_NODE),  # the ring crosses nodes, Ulysses of size 1
    (4, 4, 1, 1, 4, ULYSSES_IN_NODE),  # Ulysses over the whole world (torch reuses WORLD)
    (8, 4, 2, 1, 4, ULYSSES_IN_NODE),
    (8, 2, 2, 2, 4, RING_IN_NODE),
    (8, 2, 2, 2, 2, ULYSSES_IN_NODE),
]
GROUP_NAMES = ("ulysses", "ring", "sp", "dp", "dp_sp")


def _cached_topology(u, r, d, rpn, placement):
    key = ("test_topology_dist", u, r, d, rpn, placement)
    return worker_cached(
        key, lambda: build_topology(u, r, dp_degree=d, ranks_per_node=rpn, placement=placement)
    )


def _one_hot_sum(group) -> list[float]:
    """All-reduce of this rank's one-hot vector over ``group``: 1.0 at every member."""
    t = torch.zeros(dist.get_world_size())
    t[dist.get_rank()] = 1.0
    dist.all_reduce(t, group=group)
    return t.tolist()


def _gather_order(group) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order."""
    size = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t.item()) for t in out]


def _probe(u, r, d, rpn, placement):
    topo = _cached_topology(u, r, d, rpn, placement)
    groups = {
        "ulysses": topo.ulysses_group,
        "ring": topo.ring_group,
        "sp": topo.sp_group,
        "dp": topo.dp_group,
        "dp_sp": topo.dp_sp_group,
    }
    return {
        "sums": {name: _one_hot_sum(g) for name, g in groups.items()},
        "orders": {name: _gather_order(g) for name, g in groups.items()},
        "group_ranks": {name: dist.get_rank(g) for name, g in groups.items()},
        "attrs": {
            k: getattr(topo, k)
            for k in (
                "rank",
                "world_size",
                "ulysses_degree",
                "ring_degree",
                "sp_degree",
                "dp_degree",
                "ulysses_rank",
                "ring_rank",
                "sp_rank",
                "dp_rank",
                "node",
                "local_rank",
                "ulysses_global_ranks",
                "ring_global_ranks",
                "sp_global_ranks",
                "device_type",
            )
        },  # fmt: skip
        "rank_map": topo.rank_map,
        "mesh": topo.mesh.mesh.tolist(),
        "mesh_names": topo.mesh.mesh_dim_names,
        "mesh_coordinate": topo.mesh.get_coordinate(),
        "axis_local_ranks": [topo.mesh.get_local_rank(a) for a in ("dp", "ring", "ulysses")],
        "sp_mesh": (topo.sp_mesh.mesh.tolist(), topo.sp_mesh.mesh_dim_names),
        "dp_sp_mesh": (topo.dp_sp_mesh.mesh.tolist(), topo.dp_sp_mesh.mesh_dim_names),
        "stats_fresh": isinstance(topo.comm_stats, CommStats) and topo.comm_stats.total_sent == 0,
        "describe": repr(topo),
    }


def _expected_members(m: RankMap, rank: int) -> dict[str, list[int]]:
    return {
        "ulysses": m.ulysses_group_of(rank),
        "ring": m.ring_group_of(rank),
        "sp": m.sp_group_of(rank),
        "dp": m.dp_group_of(rank),
        "dp_sp": list(range(m.world_size)),
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: "w{}-u{}-r{}-d{}-n{}-{}".format(*c))
def test_groups_hold_exactly_the_rank_math_members(distributed, case):
    w, u, r, d, rpn, placement = case
    results = distributed.run(_probe, u, r, d, rpn, placement, world_size=w, timeout=60)
    m = RankMap(w, rpn, u, r, d, placement=placement)
    for rank, res in enumerate(results):
        c = m.coords_of(rank)
        expected = _expected_members(m, rank)
        for name in GROUP_NAMES:
            one_hot = [1.0 if x in expected[name] else 0.0 for x in range(w)]
            assert res["sums"][name] == one_hot, (rank, name)
            # torch orders every group by global rank ...
            assert res["orders"][name] == sorted(expected[name]), (rank, name)
            assert res["group_ranks"][name] == sorted(expected[name]).index(rank)
        # ... which for Ulysses and ring groups is the coordinate order.
        assert res["group_ranks"]["ulysses"] == c.ulysses
        assert res["group_ranks"]["ring"] == c.ring
        assert res["group_ranks"]["dp"] == c.dp
        assert res["rank_map"] == m
        assert res["attrs"] == {
            "rank": rank,
            "world_size": w,
            "ulysses_degree": u,
            "ring_degree": r,
            "sp_degree": u * r,
            "dp_degree": d,
            "ulysses_rank": c.ulysses,
            "ring_rank": c.ring,
            "sp_rank": c.ring * u + c.ulysses,
            "dp_rank": c.dp,
            "node": rank // rpn,
            "local_rank": rank % rpn,
            "ulysses_global_ranks": expected["ulysses"],
            "ring_global_ranks": expected["ring"],
            "sp_global_ranks": expected["sp"],
            "device_type": "cpu",
        }
        assert res["mesh"] == m.mesh_list()
        assert res["mesh_names"] == ("dp", "ring", "ulysses")
        assert list(res["mesh_coordinate"]) == [c.dp, c.ring, c.ulysses]
        assert res["axis_local_ranks"] == [c.dp, c.ring, c.ulysses]
        # Flattened meshes list ranks in sp_rank order (the mesh tensor's order).
        assert res["sp_mesh"] == (expected["sp"], ("sp",))
        assert res["dp_sp_mesh"] == (sum(m.sp_groups, []), ("dp_sp",))
        assert res["stats_fresh"]
        assert f"rank {rank}/{w}" in res["describe"] and placement in res["describe"]


def _sp_rank_differs_from_group_rank():
    topo = _cached_topology(2, 2, 1, 4, RING_IN_NODE)
    return topo.sp_rank, dist.get_rank(topo.sp_group)


def test_sp_rank_is_the_coordinate_not_the_flattened_group_rank(distributed):
    # ring-in-node, u=2, r=2: rank = ulysses * 2 + ring, sp_rank = ring * 2 + ulysses.
    results = distributed.run(_sp_rank_differs_from_group_rank, world_size=4)
    assert results == [(0, 0), (2, 1), (1, 2), (3, 3)]


def _defaults_and_errors(config_dir):
    out = {}
    topo = _cached_topology(2, 2, None, None, ULYSSES_IN_NODE)  # dp and ranks_per_node default
    out["defaults"] = (
        topo.dp_degree,
        topo.rank_map.ranks_per_node,
        "LOCAL_WORLD_SIZE" in os.environ,
    )
    for name, call in (
        ("rest", lambda: build_topology(3, 1)),
        ("product", lambda: build_topology(2, 2, dp_degree=2)),
        ("mismatch", lambda: build_topology_from_config(f"{config_dir}/2node_llama3_8b.toml")),
    ):
        try:
            call()
            out[name] = None
        except (TopologyError, ConfigError) as e:
            out[name] = str(e)
    return out


def test_defaults_and_errors_before_any_group_is_made(distributed):
    results = distributed.run(_defaults_and_errors, str(CONFIGS), world_size=4)
    for res in results:
        assert res["defaults"] == (1, 4, False)
        assert res["rest"] == (
            "ring(1) * ulysses(3) = 3 does not divide world_size(4), "
            "so dp_degree cannot take the rest of the world"
        )
        assert res["product"] == "ring(2) * ulysses(2) * dp(2) = 8 != world_size(4)"
        assert "2node_llama3_8b.toml" in res["mismatch"]
        assert "nodes(2) * gpus_per_node(8) = 16 != world_size(4)" in res["mismatch"]


def _from_config_then_destroy(config_path):
    topo = build_topology_from_config(config_path)  # fresh groups, destroyed below
    before = (topo.ulysses_degree, topo.ring_degree, topo.dp_degree, topo.ring_global_ranks)
    ring_sum = _one_hot_sum(topo.ring_group)
    ring_group = topo.ring_group
    topo.destroy()
    topo.destroy()  # idempotent
    # gloo's shutdown leaves the object callable; destroyed means unregistered from c10d.
    after = []
    for lookup in (
        lambda: dist.get_process_group_ranks(ring_group),
        lambda: topo.mesh["ring"].get_group(),
    ):
        try:
            lookup()
            after.append("still registered")
        except (KeyError, RuntimeError, ValueError) as e:
            after.append(type(e).__name__)
    world = torch.ones(1)
    dist.all_reduce(world)  # WORLD survives (it is this topology's sp and dp_sp group)
    return before, ring_sum, after, world.item()


def test_build_from_config_and_destroy(distributed):
    results = distributed.run(
        _from_config_then_destroy, str(CONFIGS / "cpu_demo.toml"), world_size=4, timeout=60
    )
    ring_groups = [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, (before, ring_sum, after, world) in enumerate(results):
        assert before == (2, 2, 1, ring_groups[rank])
        assert ring_sum == [1.0 if x in ring_groups[rank] else 0.0 for x in range(4)]
        assert "still registered" not in after, after
        assert world == 4.0


def test_default_ranks_per_node_reads_local_world_size():
    assert default_ranks_per_node(16, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert default_ranks_per_node(16, {}) == 16
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE='eight' is not an integer"):
        default_ranks_per_node(16, {"LOCAL_WORLD_SIZE": "eight"})


# One process acting as one rank of a large world (the "fake" backend: collectives
# return at once), in a subprocess so this pytest process never initialises c10d.
_FAKE_WORLD_SCRIPT = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from usp.process_groups import build_topology
out = []
for world, rank, u, r, rpn, placement in json.loads(sys.argv[1]):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    topo = build_topology(u, r, ranks_per_node=rpn, placement=placement)
    out.append({
        "coords": [topo.dp_rank, topo.ring_rank, topo.ulysses_rank],
        "mesh_coordinate": list(topo.mesh.get_coordinate()),
        "ulysses": dist.get_process_group_ranks(topo.ulysses_group),
        "ring": dist.get_process_group_ranks(topo.ring_group),
        "dp": dist.get_process_group_ranks(topo.dp_group),
        "sp": sorted(dist.get_process_group_ranks(topo.sp_group)),
        "sizes": [topo.sp_mesh.size(), topo.dp_sp_mesh.size()],
    })
    dist.destroy_process_group()
print(json.dumps(out))
"""

FAKE_CASES = [
    (1024, 700, 8, 16, 8, ULYSSES_IN_NODE),
    (1024, 333, 4, 8, 32, RING_IN_NODE),
    (256, 255, 8, 32, 8, ULYSSES_IN_NODE),
]


def test_large_worlds_with_the_fake_backend():
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_WORLD_SCRIPT, json.dumps(FAKE_CASES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (w, rank, u, r, rpn, placement), res in zip(FAKE_CASES, results, strict=True):
        m = RankMap(w, rpn, u, r, w // (u * r), placement=placement)
        c = m.coords_of(rank)
        assert res["coords"] == res["mesh_coordinate"] == [c.dp, c.ring, c.ulysses]
        assert res["ulysses"] == m.ulysses_group_of(rank)
        assert res["ring"] == m.ring_group_of(rank)
        assert res["dp"] == m.dp_group_of(rank)
        assert res["sp"] == sorted(m.sp_group_of(rank))
        assert res["sizes"] == [u * r, w]

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

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

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
    """``rpn`` given: nodes of ``rpn`` ranks are emulated (all ranks run on one host)."""
    key = ("test_topology_dist", u, r, d, rpn, placement)
    return worker_cached(
        key,
        lambda: build_topology(
            u,
            r,
            dp_degree=d,
            ranks_per_node=rpn,
            placement=placement,
            emulate_nodes=rpn is not None,
        ),
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
        ("emulate", lambda: build_topology(2, 2, emulate_nodes=True)),
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
        assert res["emulate"] == "emulate_nodes=True needs ranks_per_node (the emulated node size)"
        assert res["mismatch"].startswith(f"{CONFIGS}/2node_llama3_8b.toml: ")
        assert (
            "[cluster] config says 2 nodes x 8 ranks; the job runs on 1 node x 4 ranks"
            in res["mismatch"]
        )


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


# ----------------------------------------------------------------------------- observed nodes
# Each rank sets the variables torchrun would give it, then builds a topology: the same
# observation code as under a real multi-node launch (tests/topology/test_launch.py runs that too),
# at the cost of a few group creations. Errors must come on every rank, after which the
# world is still usable.
LAUNCH_ENV = ("GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _env_for(kind: str, rank: int) -> dict[str, str]:
    if kind == "2x2":  # torchrun, 2 nodes x 2 ranks
        return {"GROUP_RANK": rank // 2, "LOCAL_RANK": rank % 2, "LOCAL_WORLD_SIZE": 2}
    if kind == "interleaved":  # another launcher, round-robin placement (NODE_RANK)
        return {"NODE_RANK": rank % 2, "LOCAL_RANK": rank // 2, "LOCAL_WORLD_SIZE": 2}
    if kind == "3+1":  # nodes of different sizes
        node = 0 if rank < 3 else 1
        return {"GROUP_RANK": node, "LOCAL_RANK": rank % 3, "LOCAL_WORLD_SIZE": 3 - 2 * node}
    if kind == "wrong-local-size":  # LOCAL_WORLD_SIZE disagrees with what is observed
        return {"LOCAL_WORLD_SIZE": 2}
    if kind == "unparsable-on-rank-1":
        return {"LOCAL_WORLD_SIZE": "eight" if rank == 1 else "4"}
    raise ValueError(kind)


def _with_launch_env(kind: str, build):
    """``build()`` under this rank's launch variables; its result or error text, then a
    barrier (a failed build must leave the world usable)."""
    saved = {name: os.environ.pop(name, None) for name in LAUNCH_ENV}
    os.environ.update({k: str(v) for k, v in _env_for(kind, dist.get_rank()).items()})
    try:
        with build() as topo:
            result = {
                "node": topo.node,
                "local_rank": topo.local_rank,
                "nodes": topo.rank_map.describe_nodes(),
                "launcher": topo.launch.launcher,
                "ulysses": topo.ulysses_global_ranks,
                "ulysses_sum": _one_hot_sum(topo.ulysses_group),
                "describe": topo.describe(),
            }
    except (TopologyError, ConfigError) as e:
        result = {"error": str(e)}
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    dist.barrier()
    return result


def _observe(kind, u, r, placement=ULYSSES_IN_NODE, **kw):
    return _with_launch_env(kind, lambda: build_topology(u, r, placement=placement, **kw))


def _observe_config(kind, data):
    from usp.config import config_from_dict

    return _with_launch_env(
        kind, lambda: build_topology_from_config(config_from_dict(data, source="test.toml"))
    )


def test_nodes_come_from_the_launch(distributed):
    results = distributed.run(_observe, "2x2", 2, 2, world_size=4)
    for rank, res in enumerate(results):
        assert (res["node"], res["local_rank"]) == (rank // 2, rank % 2)
        assert res["nodes"] == "2 nodes x 2 ranks" and res["launcher"] == "torchrun"
        assert res["ulysses"] == [rank - rank % 2, rank - rank % 2 + 1]  # inside the node
        assert f"(node {rank // 2}, local {rank % 2})" in res["describe"]


def test_interleaved_nodes_are_observed_not_assumed(distributed):
    # ranks 0 and 2 on node 0, ranks 1 and 3 on node 1: contiguous Ulysses pairs would
    # cross nodes, the ring-in-node placement's strided pairs do not.
    results = distributed.run(_observe, "interleaved", 2, 2, world_size=4)
    for res in results:
        assert res["error"] == (
            "Ulysses group 0 (ranks [0, 1]) spans nodes 0, 1 with 2 nodes x 2 ranks (ranks "
            "interleaved across nodes), ulysses(2), ring(2), placement 'ulysses-in-node'; the "
            "all-to-all would cross slow links. Either use ulysses_degree=1 (with "
            "ring_degree=4 for the same sp size 4), or placement 'ring-in-node', or pass "
            "allow_cross_node_ulysses=True"
        )
    results = distributed.run(_observe, "interleaved", 2, 2, RING_IN_NODE, world_size=4)
    for rank, res in enumerate(results):
        assert (res["node"], res["local_rank"]) == (rank % 2, rank // 2)
        assert res["ulysses"] == [rank % 2, rank % 2 + 2]
        assert res["ulysses_sum"] == [1.0 if x % 2 == rank % 2 else 0.0 for x in range(4)]
        assert res["launcher"] == "torchrun"  # NODE_RANK counts as the node's rank too
    # allow_cross_node_ulysses keeps meaning what it says, on the real nodes
    results = distributed.run(
        _observe, "interleaved", 2, 2, allow_cross_node_ulysses=True, world_size=4
    )
    assert [res["node"] for res in results] == [0, 1, 0, 1]


def test_nodes_of_different_sizes(distributed):
    results = distributed.run(_observe, "3+1", 1, 4, world_size=4)
    assert [(res["node"], res["local_rank"]) for res in results] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert {res["nodes"] for res in results} == {"2 nodes with 3 and 1 ranks"}
    results = distributed.run(_observe, "3+1", 2, 2, world_size=4)
    for res in results:
        assert res["error"].startswith(
            "Ulysses group 1 (ranks [2, 3]) spans nodes 0, 1 with 2 nodes with 3 and 1 ranks"
        )


def test_declared_node_size_that_contradicts_the_launch(distributed):
    results = distributed.run(_observe, "2x2", 4, 1, ranks_per_node=4, world_size=4)
    for res in results:
        assert res["error"] == (
            "ranks_per_node=4 says 1 node x 4 ranks; torchrun launched 2 nodes x 2 ranks. "
            "Leave ranks_per_node unset to use the launch's nodes, or pass "
            "emulate_nodes=True to pretend other nodes on purpose"
        )


def test_inconsistent_launch_environment_fails_on_every_rank(distributed):
    for kind, message in (
        (
            "wrong-local-size",
            "rank 0 has LOCAL_WORLD_SIZE=2, but 4 rank(s) run on its node (node 0); the job "
            "runs on 1 node x 4 ranks: the launch environment is inconsistent",
        ),
        (
            "unparsable-on-rank-1",
            "LOCAL_WORLD_SIZE is not an integer >= 0 in the environment of rank(s) 1",
        ),
    ):
        for res in distributed.run(_observe, kind, 2, 2, world_size=4):
            assert res["error"].startswith(message), res


CONFIG_2x2 = {
    "cluster": {"nodes": 2, "gpus_per_node": 2},
    "parallel": {"ulysses": "auto", "ring": "auto"},
    "model": {"num_heads": 4, "num_kv_heads": 2},
}


def test_config_against_the_launch(distributed):
    auto = {**CONFIG_2x2, "cluster": {"nodes": "auto", "gpus_per_node": "auto"}}
    # auto degrees respect the observed nodes: Ulysses 2 inside each node, a ring of 2
    for config in (CONFIG_2x2, auto):
        results = distributed.run(_observe_config, "2x2", config, world_size=4)
        assert [res["ulysses"] for res in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [res["node"] for res in results] == [0, 0, 1, 1]
    one_node = {**CONFIG_2x2, "cluster": {"nodes": 1, "gpus_per_node": 4}}
    for res in distributed.run(_observe_config, "2x2", one_node, world_size=4):
        assert res["error"] == (
            "test.toml: [cluster] config says 1 node x 4 ranks; torchrun launched 2 nodes x 2 "
            "ranks. Make [cluster] nodes and gpus_per_node match the launch, or set "
            'nodes = "auto" and gpus_per_node = "auto" to take the launch\'s shape'
        )
    half_auto = {**CONFIG_2x2, "cluster": {"nodes": "auto", "gpus_per_node": 4}}
    for res in distributed.run(_observe_config, "2x2", half_auto, world_size=4):
        assert (
            "config says auto nodes x 4 ranks; torchrun launched 2 nodes x 2 ranks"
            in (res["error"])
        )
        assert 'or set gpus_per_node = "auto"' in res["error"]


# ----------------------------------------------------------------------------- lifecycle
def _use_after_destroy():
    import usp

    with build_topology(2, 2) as topo:
        q = torch.randn(1, 8, 4, 8, generator=torch.Generator().manual_seed(0))
        before = usp.usp_attention(q, q, q, topo, causal=True).shape
    assert topo.destroyed
    errors = {}
    for name, use in (
        ("ulysses_group", lambda: topo.ulysses_group),
        ("sp_mesh", lambda: topo.sp_mesh),
        ("usp_attention", lambda: usp.usp_attention(q, q, q, topo, causal=True)),
        ("plan.gather", lambda: usp.Plan(topo).gather(q)),
    ):
        try:
            use()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the test reports whatever was raised
            errors[name] = (type(e).__name__, str(e))
    topo.destroy()  # idempotent, and nothing collective: a lone call cannot hang
    world = torch.ones(1)
    dist.all_reduce(world)
    return before, errors, repr(topo), topo.sp_degree, world.item()


def test_using_a_destroyed_topology_is_a_clear_error(distributed):
    for before, errors, text, sp, world in distributed.run(_use_after_destroy, world_size=4):
        assert before == (1, 8, 4, 8)
        for name, error in errors.items():
            assert error is not None, name
            kind, message = error
            assert kind == "TopologyDestroyedError", (name, error)
            assert "the topology was destroyed (Topology.destroy() or the end of its `with`" in (
                message
            )
            assert "0x" not in message  # no object addresses
        assert text.endswith("(destroyed))") and sp == 4 and world == 4.0


def _error_inside_with():
    topo = build_topology(2, 2)
    try:
        with topo:
            raise ValueError("every rank fails inside the block")
    except ValueError:
        pass
    assert topo.destroyed
    dist.barrier()  # no rank is stuck in a teardown barrier
    return True


def test_an_error_inside_the_with_block_leaves_without_a_collective(distributed):
    assert distributed.run(_error_inside_with, world_size=4, timeout=60) == [True] * 4


def _emulated_config(data):
    from usp.config import config_from_dict

    try:
        with build_topology_from_config(
            config_from_dict(data, source="test.toml"), emulate_nodes=True
        ) as topo:
            return topo.node, topo.launch, topo.ulysses_global_ranks
    except ConfigError as e:
        return str(e)


def test_config_with_emulated_nodes(distributed):
    # one host, but the config's 2 nodes x 2 ranks are taken as given
    results = distributed.run(_emulated_config, CONFIG_2x2, world_size=4)
    assert results == [(0, None, [0, 1]), (0, None, [0, 1]), (1, None, [2, 3]), (1, None, [2, 3])]
    three = {**CONFIG_2x2, "cluster": {"nodes": 3, "gpus_per_node": 2}}
    for res in distributed.run(_emulated_config, three, world_size=4):
        assert res == (
            "test.toml: [cluster] config says 3 nodes x 2 ranks (6 ranks); the running job has "
            "4 ranks"
        )

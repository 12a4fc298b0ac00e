"""Reading the launch (pure): environment variables and host names -> a node per rank,
and a config's [cluster] section checked against it. No processes needed."""

import pytest

from usp.config import ConfigError, config_from_dict
from usp.process_groups.launch import (
    UNPARSABLE,
    UNSET,
    Launch,
    RankLaunch,
    host_id,
    rank_launch_from_env,
)
from usp.process_groups.rank_math import TopologyError


def torchrun(nodes: list[int], host: str = "localhost") -> list[RankLaunch]:
    """What torchrun gives each rank when node ``i`` runs ``nodes[i]`` processes."""
    return [
        RankLaunch(group, local, size, host_id(host))
        for group, size in enumerate(nodes)
        for local in range(size)
    ]


def test_environment_parsing():
    env = {"GROUP_RANK": "1", "NODE_RANK": "7", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    assert rank_launch_from_env(env, "gpu-a") == RankLaunch(1, 3, 4, host_id("gpu-a"))
    assert rank_launch_from_env({"NODE_RANK": "2"}, "h").group_rank == 2  # other launchers
    assert rank_launch_from_env({}, "h") == RankLaunch(UNSET, UNSET, UNSET, host_id("h"))
    bad = rank_launch_from_env({"LOCAL_WORLD_SIZE": "eight", "LOCAL_RANK": "-1"}, "h")
    assert bad.local_world_size == UNPARSABLE and bad.local_rank == UNPARSABLE
    # the host id is stable across processes (Python's hash() is not) and fits int64
    assert host_id("gpu-a") == host_id("gpu-a") != host_id("gpu-b")
    assert -(2**63) <= host_id("gpu-a") < 2**63


def test_torchrun_nodes():
    launch = Launch.from_ranks(torchrun([2, 2]))
    assert launch.node_of_rank == (0, 0, 1, 1) and launch.node_sizes == (2, 2)
    assert launch.uniform and launch.contiguous and launch.world_size == 4
    assert launch.launched() == "torchrun launched 2 nodes x 2 ranks"
    uneven = Launch.from_ranks(torchrun([3, 1]))
    assert uneven.node_sizes == (3, 1) and not uneven.uniform
    assert uneven.describe() == "2 nodes with 3 and 1 ranks"


def test_nodes_by_host_without_torchrun():
    # two hosts, round-robin placement, no launcher variables at all
    ranks = [RankLaunch(UNSET, UNSET, UNSET, host_id(f"host{r % 2}")) for r in range(6)]
    launch = Launch.from_ranks(ranks)
    assert launch.node_of_rank == (0, 1, 0, 1, 0, 1) and not launch.contiguous
    assert launch.launched() == (
        "the job runs on 2 nodes x 3 ranks (ranks interleaved across nodes)"
    )
    # one host, no variables: one node (how the test harness runs)
    assert Launch.from_ranks(ranks[::2]).node_of_rank == (0, 0, 0)


def test_two_agents_on_one_host_are_two_nodes():
    # `torchrun --nnodes 2 --node-rank {0,1}` twice on one machine: same host name
    assert Launch.from_ranks(torchrun([2, 2], host="same")).num_nodes == 2


@pytest.mark.parametrize(
    "ranks, message",
    [
        (
            [RankLaunch(0, 0, 2, 1), RankLaunch(0, 1, 2, 2)],
            "ranks 0 and 1 report the same node (GROUP_RANK/NODE_RANK 0) from different hosts",
        ),
        (
            [RankLaunch(0, 0, 2, 1), RankLaunch(0, 0, 2, 1)],
            "ranks 0 and 1 both have LOCAL_RANK=0 on node 0",
        ),
        (
            [RankLaunch(0, 0, 3, 1), RankLaunch(0, 1, 3, 1)],
            "rank 0 has LOCAL_WORLD_SIZE=3, but 2 rank(s) run on its node (node 0); "
            "torchrun launched 1 node x 2 ranks",
        ),
        (
            [RankLaunch(UNPARSABLE, 0, 2, 1), RankLaunch(0, 1, 2, 1)],
            "GROUP_RANK or NODE_RANK is not an integer >= 0 in the environment of rank(s) 0",
        ),
        ([], "a launch needs at least one rank"),
    ],
)
def test_inconsistent_launches(ranks, message):
    with pytest.raises(TopologyError) as info:
        Launch.from_ranks(ranks)
    assert str(info.value).startswith(message)


# ----------------------------------------------------------------------------- config vs launch
def _config(nodes, gpus, **parallel):
    return config_from_dict(
        {
            "cluster": {"nodes": nodes, "gpus_per_node": gpus},
            "parallel": {"ulysses": "auto", "ring": "auto", **parallel},
            "model": {"num_heads": 8, "num_kv_heads": 2},
        },
        source="c.toml",
    )


@pytest.mark.parametrize(
    "nodes, gpus",
    [(2, 4), ("auto", 4), (2, "auto"), ("auto", "auto")],
)
def test_config_that_describes_the_launch(nodes, gpus):
    resolved = _config(nodes, gpus).resolve(launch=Launch.from_ranks(torchrun([4, 4])))
    assert (resolved.ulysses, resolved.ring, resolved.dp) == (4, 2, 1)  # Ulysses in a node
    assert resolved.config.cluster == _config(2, 4).cluster  # "auto" filled in
    assert resolved.rank_map.describe_nodes() == "2 nodes x 4 ranks"


@pytest.mark.parametrize(
    "nodes, gpus, launched, expected",
    [
        (
            1,
            4,
            [2, 2],
            "c.toml: [cluster] config says 1 node x 4 ranks; torchrun launched 2 nodes x 2 "
            "ranks. Make [cluster] nodes and gpus_per_node match the launch, or set "
            'nodes = "auto" and gpus_per_node = "auto" to take the launch\'s shape',
        ),
        (
            2,
            8,
            [4, 4, 4, 4],
            "c.toml: [cluster] config says 2 nodes x 8 ranks; torchrun launched 4 nodes x 4 ranks.",
        ),
        (
            "auto",
            2,
            [4, 4],
            "c.toml: [cluster] config says auto nodes x 2 ranks; torchrun launched 2 nodes x 4 "
            'ranks. Make [cluster] gpus_per_node match the launch, or set gpus_per_node = "auto"',
        ),
        (3, "auto", [4, 4], "config says 3 nodes x auto ranks; torchrun launched 2 nodes x 4"),
        (2, 2, [3, 1], "config says 2 nodes x 2 ranks; torchrun launched 2 nodes with 3 and 1"),
    ],
)
def test_config_that_contradicts_the_launch(nodes, gpus, launched, expected):
    with pytest.raises(ConfigError) as info:
        _config(nodes, gpus).resolve(launch=Launch.from_ranks(torchrun(launched)))
    assert str(info.value).startswith("c.toml: [cluster] config says ")
    assert expected in str(info.value)


def test_auto_cluster_takes_uneven_nodes():
    resolved = _config("auto", "auto").resolve(launch=Launch.from_ranks(torchrun([4, 2])))
    # Ulysses 2 fits inside both nodes; Ulysses 3 or 6 is not allowed by 8 heads
    assert (resolved.ulysses, resolved.ring) == (2, 3)
    assert resolved.config.cluster.nodes == 2
    assert resolved.config.cluster.gpus_per_node == "auto"  # uneven: see the rank map
    assert resolved.rank_map.node_sizes == (4, 2)


def test_auto_cluster_without_a_launch_needs_numbers():
    with pytest.raises(ConfigError, match=r'gpus_per_node = "auto" is taken from the launch'):
        _config(2, "auto").resolve()
    with pytest.raises(ConfigError, match=r'nodes = "auto" is taken from the launch'):
        _config("auto", 4).resolve()
    assert _config("auto", 4).resolve(world_size=16).config.cluster.nodes == 4
    with pytest.raises(ConfigError, match="the world size comes from the launch"):
        _ = _config("auto", 4).cluster.world_size
    with pytest.raises(ConfigError, match=r"world_size\(8\) differs from the launch's 4 ranks"):
        _config(2, 2).resolve(8, launch=Launch.from_ranks(torchrun([2, 2])))

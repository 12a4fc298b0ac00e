"""Topology: ranks -> (dp, ring, ulysses) coordinates, nodes, process groups, DeviceMesh.

``rank_math`` and ``degrees`` are pure (any world size, no process group needed);
``launch`` observes where the launcher put every rank (one tensor all-gather);
``topology`` creates the groups after ``torch.distributed.init_process_group``.
"""

from usp.process_groups.degrees import (
    HeadLayoutError,
    describe_valid_pairs,
    format_pairs,
    kv_replication,
    suggest_degrees,
    valid_degree_pairs,
)
from usp.process_groups.launch import Launch, RankLaunch, observe_launch
from usp.process_groups.rank_math import (
    MAX_WORLD_SIZE,
    PLACEMENTS,
    RING_IN_NODE,
    ULYSSES_IN_NODE,
    Coords,
    RankInfo,
    RankMap,
    TopologyError,
)
from usp.process_groups.single import SINGLE_PROCESS, SingleProcess, as_topology
from usp.process_groups.topology import (
    MESH_AXES,
    Topology,
    TopologyDestroyedError,
    build_topology,
)

__all__ = [
    "MESH_AXES",
    "PLACEMENTS",
    "RING_IN_NODE",
    "ULYSSES_IN_NODE",
    "Coords",
    "HeadLayoutError",
    "Launch",
    "MAX_WORLD_SIZE",
    "RankInfo",
    "RankLaunch",
    "RankMap",
    "SINGLE_PROCESS",
    "SingleProcess",
    "Topology",
    "TopologyDestroyedError",
    "TopologyError",
    "as_topology",
    "build_topology",
    "describe_valid_pairs",
    "format_pairs",
    "kv_replication",
    "observe_launch",
    "suggest_degrees",
    "valid_degree_pairs",
]

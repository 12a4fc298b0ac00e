"""Building the running job's :class:`~usp.process_groups.Topology` from a config."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from usp.config.schema import UspConfig, load_config
from usp.config.toml import AUTO, located
from usp.errors import ConfigError
from usp.process_groups.launch import can_observe_launch, observe_launch
from usp.process_groups.topology import default_device_type, topology_from_rank_map


def build_topology_from_config(
    config_or_path: UspConfig | str | os.PathLike,
    *,
    device_type: str | None = None,
    emulate_nodes: bool = False,
    **overrides: Any,
):
    """:func:`~usp.process_groups.topology.build_topology` from a config, after
    ``init_process_group``; every rank must call it.

    The config's ``[cluster]`` must describe the running launch, which is observed
    (every rank's node, from torchrun's environment and the host names): a mismatch is a
    :class:`ConfigError` on every rank naming both shapes (``config says 1 node x 4
    ranks; torchrun launched 2 nodes x 2 ranks``). ``nodes = "auto"`` and
    ``gpus_per_node = "auto"`` take the launch's values. ``emulate_nodes=True`` uses the
    config's nodes as given instead (tests, single-machine emulation of a cluster; also
    what the ``fake`` backend gets, since it cannot observe anything).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_topology_from_config needs torch.distributed.init_process_group first"
        )
    if isinstance(config_or_path, UspConfig):
        config = config_or_path.with_overrides(**overrides) if overrides else config_or_path
    else:
        config = load_config(config_or_path, **overrides)
    device_type = device_type or default_device_type()
    world_size = dist.get_world_size()
    launch = None
    if emulate_nodes or not can_observe_launch():
        cluster = config.cluster
        if cluster.gpus_per_node == AUTO:
            raise ConfigError(
                located(
                    config.source,
                    '[cluster] gpus_per_node = "auto" needs an observed launch; with emulated '
                    "nodes give the emulated node size",
                )
            )
        if cluster.nodes != AUTO and cluster.nodes * cluster.gpus_per_node != world_size:
            raise ConfigError(
                located(
                    config.source,
                    f"[cluster] config says {cluster.describe()} "
                    f"({cluster.nodes * cluster.gpus_per_node} ranks); the running job has "
                    f"{world_size} ranks",
                )
            )
        resolved = config.resolve(world_size)
    else:
        launch = observe_launch(device_type)
        resolved = config.resolve(launch=launch)
    return topology_from_rank_map(resolved.rank_map, device_type, launch=launch)


def check_topology_matches(config: UspConfig, topology) -> None:
    """A topology built elsewhere must have the degrees the config gives as numbers
    (``"auto"`` matches any); else a :class:`ConfigError` naming both (the same on every
    rank: both are the same everywhere)."""
    degrees = {
        "ulysses": topology.ulysses_degree,
        "ring": topology.ring_degree,
        "dp": topology.dp_degree,
    }
    wanted = {key: getattr(config.parallel, key) for key in degrees}
    wrong = [key for key, value in wanted.items() if value != AUTO and value != degrees[key]]
    if wrong:
        says = ", ".join(f"{key} = {wanted[key]}" for key in wrong)
        has = " x ".join(f"{key} {value}" for key, value in degrees.items())
        raise ConfigError(
            located(
                config.source,
                f"[parallel] says {says}; the topology given has {has}. Make [parallel] "
                'match it (or set the key to "auto")',
            )
        )

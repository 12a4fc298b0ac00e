"""Building the running job's :class:`~usp.process_groups.Topology` from a config."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from usp.config.fields import is_int
from usp.config.resolve import check_cluster_matches_launch
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
        check_grid_fits(config, world_size)
        resolved = config.resolve(world_size)
    else:
        launch = observe_launch(device_type)
        try:
            check_cluster_matches_launch(config.cluster, launch)
        except ConfigError as err:
            raise ConfigError(located(config.source, str(err))) from None
        check_grid_fits(config, world_size)
        resolved = config.resolve(launch=launch)
    return topology_from_rank_map(resolved.rank_map, device_type, launch=launch)


class GridSizeError(ConfigError):
    """A config's ``[parallel]`` degrees that do not fit the running job's world size.
    ``grid``: (ulysses, ring, dp) as the config gives them (``"auto"`` or a number);
    :meth:`with_fixes` adds the flags of a command that fix it."""

    def __init__(self, message: str, *, grid: tuple, world_size: int):
        super().__init__(message)
        self.grid, self.world_size = grid, world_size

    def grid_flags(self) -> str:
        """``--ulysses/--ring/--dp`` values that run this config on this world size."""
        u, r, _ = self.grid
        world = self.world_size
        if world == 1:
            return "--ulysses 1 --ring 1 --dp 1"
        if is_int(u) and is_int(r) and world % (u * r) == 0:
            return f"--dp {world // (u * r)}"
        return "--ulysses auto --ring auto --dp 1"

    def with_fixes(self, launch: str | None = None) -> str:
        """The message and what fixes it on a command with ``--ulysses/--ring/--dp``:
        this run's grid, or (``launch``, a command line with ``{ranks}``) a launch of
        the config's ranks (an auto dp as 1) when ulysses and ring are numbers."""
        text = f"{self}; to run it on {self.world_size} rank(s), give {self.grid_flags()}"
        u, r, d = self.grid
        if launch is not None and is_int(u) and is_int(r):
            ranks = u * r * (d if is_int(d) else 1)
            text += f", or launch {ranks} ranks: {launch.format(ranks=ranks)}"
        return text


def check_grid_fits(config: UspConfig, world_size: int) -> None:
    """A :class:`GridSizeError` when the config's numeric degrees cannot make
    ``world_size`` ranks (their product differs from it, or, with an ``"auto"``
    degree, does not divide it)."""
    p = config.parallel
    grid = (p.ulysses, p.ring, p.dp)
    numbers = {k: v for k, v in zip(("ulysses", "ring", "dp"), grid) if v != AUTO}
    product = 1
    for value in numbers.values():
        product *= value
    complete = len(numbers) == 3
    if (complete and product == world_size) or (not complete and world_size % product == 0):
        return
    shown = " * ".join(f"{k}({v})" for k, v in numbers.items())
    relation = "!=" if complete else "does not divide"
    raise GridSizeError(
        located(
            config.source,
            f"[parallel] {shown} = {product} {relation} the running job's world_size({world_size})",
        ),
        grid=grid,
        world_size=world_size,
    )


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

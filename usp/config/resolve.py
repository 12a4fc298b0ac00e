"""``"auto"`` degrees: how a config's ``[parallel]`` becomes numbers, checked against the
rank math (no process group needed; any world size).

- ``ulysses = "auto"``: the largest Ulysses degree whose groups stay inside a node and
  that the model's head counts allow (see :mod:`usp.process_groups.degrees`); when
  ``ring`` and ``dp`` are both numbers, simply ``world / (ring * dp)``.
- ``ring = "auto"``: the rest of the sequence-parallel size, ``sp / ulysses`` with
  ``sp = world / dp`` (``dp = 1`` when dp is also auto).
- ``dp = "auto"``: the rest of the world, ``world / (ulysses * ring)``.

At run time the cluster is compared with the launch that is really running: a config
that disagrees with it is an error naming both shapes; ``nodes = "auto"`` /
``gpus_per_node = "auto"`` take the launch's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from usp.config.fields import is_int
from usp.config.sections import ClusterConfig, ModelConfig, ParallelConfig
from usp.config.toml import AUTO
from usp.errors import ConfigError, TopologyError
from usp.process_groups.degrees import kv_replication_for
from usp.process_groups.launch import Launch
from usp.process_groups.rank_math import (
    RankMap,
    check_world_size,
    divisors,
    fitting_ulysses_degrees,
    node_sizes_of,
)


class _Sections(Protocol):
    """What resolution reads of a :class:`~usp.config.schema.UspConfig` (a dataclass)."""

    cluster: ClusterConfig
    parallel: ParallelConfig
    model: ModelConfig | None


def resolve_config(
    config: _Sections, world_size: int | None, launch: Launch | None
) -> tuple[_Sections, int, RankMap, int | None]:
    """:meth:`UspConfig.resolve`: with the running job's ``launch``, or for a planned
    world size (default ``nodes * gpus_per_node``). Returns the config with numeric
    degrees (``dataclasses.replace``), the world size, the rank map and the KV
    replication (None without a ``[model]``)."""
    if launch is not None:
        if world_size is not None and world_size != launch.world_size:
            raise ConfigError(
                f"world_size({world_size}) differs from the launch's {launch.world_size} ranks"
            )
        check_cluster_matches_launch(config.cluster, launch)
        return _resolve(config, launch.world_size, launch.node_of_rank)
    return _resolve(*_planned_cluster(config, world_size), None)


def _planned_cluster(config: _Sections, world_size: int | None) -> tuple[_Sections, int]:
    """The config and world size to check a file against when there is no launch.

    A ``"auto"`` cluster value is what the launch would give, so without one it comes
    from the rest: ``gpus_per_node = "auto"`` is ``world / nodes`` (one node when
    ``nodes`` is auto too), ``nodes = "auto"`` is ``world / gpus_per_node``; the world
    is ``world_size`` when given, else ``nodes * gpus_per_node`` when both are numbers,
    else the grid's own (``ulysses * ring * dp``, the smallest ``dp`` that fills whole
    nodes when dp is auto). The commands that check a file without a launch (``usp
    topo``, ``usp data``) both take the flags the messages name."""
    cluster, p = config.cluster, config.parallel
    nodes, per_node = cluster.nodes, cluster.gpus_per_node
    if per_node != AUTO:
        if world_size is None and nodes != AUTO:
            return config, nodes * per_node
        world = world_size if world_size is not None else _grid_world(p, per_node)
        if world is None:
            raise ConfigError(
                '[cluster] nodes = "auto" is taken from the launch, and [parallel] leaves '
                'the world size open ("auto" degrees); to check this config without a '
                "launch, give the world size (--world-size N) or the node count "
                "(--set cluster.nodes=N)"
            )
        return config, world
    world = world_size if world_size is not None else _grid_world(p, 1 if nodes == AUTO else nodes)
    if world is None:
        raise ConfigError(
            '[cluster] gpus_per_node = "auto" is taken from the launch, and [parallel] '
            'leaves the world size open ("auto" degrees); to check this config without a '
            "launch, give the world size (--world-size N) or the ranks per node "
            "(--set cluster.gpus_per_node=N)"
        )
    count = 1 if nodes == AUTO else nodes
    if world % count != 0:
        raise ConfigError(
            f"world_size({world}) is not a multiple of [cluster] nodes({count}), so "
            '[cluster] gpus_per_node = "auto" has no value'
        )
    return replace(config, cluster=replace(cluster, gpus_per_node=world // count)), world


def _grid_world(parallel: ParallelConfig, node_size: int) -> int | None:
    """``ulysses * ring * dp`` when ulysses and ring are numbers; an auto dp is the
    smallest that makes the world a multiple of ``node_size``. None otherwise."""
    u, r, d = parallel.ulysses, parallel.ring, parallel.dp
    if u == AUTO or r == AUTO:
        return None
    if d == AUTO:
        d = node_size // math.gcd(u * r, node_size)
    return u * r * d


def check_cluster_matches_launch(cluster: ClusterConfig, launch: Launch) -> None:
    """The ``[cluster]`` section must describe the running launch; ``"auto"`` matches.

    The message names both shapes, e.g. ``config says 1 node x 4 ranks; torchrun
    launched 2 nodes x 2 ranks``.
    """
    sizes = launch.node_sizes
    problems = []
    if cluster.nodes != AUTO and cluster.nodes != len(sizes):
        problems.append("nodes")
    if cluster.gpus_per_node != AUTO and any(s != cluster.gpus_per_node for s in sizes):
        problems.append("gpus_per_node")
    if not problems:
        return
    keys = " and ".join(problems)
    autos = " and ".join(f'{key} = "auto"' for key in problems)
    raise ConfigError(
        f"[cluster] config says {cluster.describe()}; {launch.launched()}. Make [cluster] "
        f"{keys} match the launch, or set {autos} to take the launch's shape"
    )


def _resolve(
    config: _Sections, world_size: int, node_of_rank: tuple[int, ...] | None
) -> tuple[_Sections, int, RankMap, int | None]:
    if not is_int(world_size) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    check_world_size("world_size", world_size)
    if node_of_rank is None:
        ranks_per_node = config.cluster.gpus_per_node
        if world_size % ranks_per_node != 0:
            raise ConfigError(
                f"world_size({world_size}) is not a multiple of [cluster] "
                f"gpus_per_node({ranks_per_node})"
            )
    else:
        ranks_per_node = max(node_sizes_of(node_of_rank))
    nodes = _NodeLayout(world_size, ranks_per_node, node_of_rank, config.parallel.placement)
    u, r, d = _resolve_degrees(config, world_size, nodes)
    p = config.parallel
    degrees = dict(
        ulysses_degree=u,
        ring_degree=r,
        dp_degree=d,
        placement=p.placement,
        allow_cross_node_ulysses=p.allow_cross_node_ulysses,
    )
    try:
        if node_of_rank is None:
            rank_map = RankMap(world_size=world_size, ranks_per_node=ranks_per_node, **degrees)
        else:
            rank_map = RankMap.from_nodes(node_of_rank, **degrees)
    except TopologyError as e:
        raise TopologyError(f"[parallel] {_config_wording(str(e))}") from None
    kv = _check_heads(config.model, u, r * u, ranks_per_node)
    uniform = node_of_rank is None or len(set(node_sizes_of(node_of_rank))) == 1
    resolved = replace(
        config,
        cluster=replace(
            config.cluster,
            nodes=rank_map.num_nodes,
            gpus_per_node=ranks_per_node if uniform else AUTO,  # uneven: see rank_map
        ),
        parallel=replace(p, ulysses=u, ring=r, dp=d),
    )
    return resolved, world_size, rank_map, kv


@dataclass(frozen=True)
class _NodeLayout:
    """The node layout ``auto`` degrees must respect (uniform, or observed per rank)."""

    world_size: int
    ranks_per_node: int
    node_of_rank: tuple[int, ...] | None  # None: uniform nodes of ranks_per_node
    placement: str

    def fitting_ulysses(self, sp: int) -> set[int]:
        return set(
            fitting_ulysses_degrees(
                sp,
                self.ranks_per_node,
                self.placement,
                self.world_size,
                node_of_rank=self.node_of_rank,
            )
        )


def _config_wording(message: str) -> str:
    return message.replace(
        "pass allow_cross_node_ulysses=True", "set allow_cross_node_ulysses = true"
    )


def _check_heads(model: ModelConfig | None, u: int, sp: int, ranks_per_node: int) -> int | None:
    if model is None:
        return None
    return kv_replication_for(
        model.num_heads, model.num_kv_heads, u, sp, ranks_per_node,
        subject=f"[model] does not fit [parallel] ulysses = {u}",
    )  # fmt: skip


def _exact(world_size: int, factors: dict[str, int]) -> int:
    """``world_size / prod(factors)``, or an error printing every factor."""
    product = 1
    for value in factors.values():
        product *= value
    if world_size % product != 0:
        shown = " * ".join(f"{k}({v})" for k, v in factors.items())
        raise ConfigError(
            f"[parallel] {shown} = {product} does not divide world_size({world_size})"
        )
    return world_size // product


def _resolve_degrees(
    config: _Sections, world_size: int, nodes: _NodeLayout
) -> tuple[int, int, int]:
    """``(ulysses, ring, dp)`` with every ``"auto"`` replaced (rules in the module doc)."""
    p = config.parallel
    u, r, d = p.ulysses, p.ring, p.dp
    if u == AUTO:
        u = _auto_ulysses(config, world_size, nodes, ring=r, dp=d)
    if r == AUTO:
        r = _exact(world_size, {"ulysses": u} if d == AUTO else {"ulysses": u, "dp": d})
    if d == AUTO:
        d = _exact(world_size, {"ring": r, "ulysses": u})
    return u, r, d


def _auto_ulysses(
    config: _Sections, world_size: int, nodes: _NodeLayout, *, ring: int | str, dp: int | str
) -> int:
    """The largest Ulysses degree the heads allow whose groups stay inside nodes.

    Each candidate costs O(1) for uniform nodes (closed-form node checks), so a world of
    2**31 ranks resolves in milliseconds.
    """
    if ring != AUTO and dp != AUTO:
        return _exact(world_size, {"ring": ring, "dp": dp})
    if dp != AUTO:  # ring auto: Ulysses first, the ring takes the rest of sp
        sp = _exact(world_size, {"dp": dp})
        sp_sizes = {u: sp for u in divisors(sp)}
    elif ring != AUTO:  # dp auto: Ulysses first, dp takes the rest of the world
        sp_sizes = {u: u * ring for u in divisors(_exact(world_size, {"ring": ring}))}
    else:  # both auto: sequence parallelism over the whole world
        sp_sizes = {u: world_size for u in divisors(world_size)}
    model = config.model
    fits: dict[int, set[int]] = {}  # sp -> Ulysses degrees whose groups stay inside nodes
    for u in sorted(sp_sizes, reverse=True):
        sp = sp_sizes[u]
        if model is not None and model.num_heads % u != 0:  # num_kv_heads | num_heads: checked
            continue
        if sp not in fits:
            fits[sp] = nodes.fitting_ulysses(sp)
        if u in fits[sp]:
            return u
    return 1  # unreachable: u = 1 always fits

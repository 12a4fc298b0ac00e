"""Topology config files (TOML): a cluster, parallel degrees, attention options, a model.

Format (see ``examples/configs/`` for commented files)::

    [cluster]
    nodes = 2                     # int or "auto" (= what the launcher started)
    gpus_per_node = 8             # = ranks per node; int or "auto"

    [parallel]
    ulysses = 8                   # int or "auto"
    ring = 2                      # int or "auto"
    dp = 1                        # int or "auto" (= the rest of the world); default "auto"
    placement = "ulysses-in-node" # or "ring-in-node"
    allow_cross_node_ulysses = false

    [attention]                   # optional
    layout = "zigzag"             # or "contiguous"
    ring_impl = "p2p"             # or "allgather"
    backend = "auto"              # or cudnn, flash, efficient, flash_attn, cpu, math

    [model]                       # optional: validates / chooses the Ulysses degree
    num_heads = 32
    num_kv_heads = 8              # default num_heads
    head_dim = 128                # optional, only for byte estimates

At run time the cluster is compared with the launch that is really running
(:func:`build_topology_from_config`): a config that disagrees with it is an error naming
both shapes; ``nodes = "auto"`` / ``gpus_per_node = "auto"`` take the launch's values.

``"auto"`` degrees are resolved by :meth:`UspConfig.resolve`:

- ``ulysses = "auto"``: the largest Ulysses degree whose groups stay inside a node and
  that the model's head counts allow (see :mod:`usp.process_groups.degrees`); when
  ``ring`` and ``dp`` are both numbers, simply ``world / (ring * dp)``.
- ``ring = "auto"``: the rest of the sequence-parallel size, ``sp / ulysses`` with
  ``sp = world / dp`` (``dp = 1`` when dp is also auto).
- ``dp = "auto"``: the rest of the world, ``world / (ulysses * ring)``.

Every error is a :class:`ConfigError` naming the file and the ``[section] key``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from usp.errors import ConfigError  # noqa: F401 - re-exported here
from usp.options import BACKENDS, LAYOUTS, RING_IMPLS  # one source; imports nothing
from usp.process_groups.degrees import (
    HeadLayoutError,
    describe_valid_pairs,
    kv_replication,
)
from usp.process_groups.launch import Launch
from usp.process_groups.rank_math import (
    PLACEMENTS,
    ULYSSES_IN_NODE,
    RankMap,
    TopologyError,
    check_world_size,
    describe_uniform_nodes,
    divisors,
    fitting_ulysses_degrees,
    node_sizes_of,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

AUTO = "auto"
# A topology config is a few hundred bytes; refuse to read more than this (a device file,
# a mistaken path to a dataset) instead of loading it into memory.
MAX_CONFIG_BYTES = 1 << 20


# ----------------------------------------------------------------------------- value checks
def toml_repr(value: Any) -> str:
    """A value as the user wrote it in TOML: strings in double quotes, lowercase bools."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(section: str, key: str, value: Any, *, auto: bool = False) -> None:
    if is_int(value) and value >= 1:
        return
    if auto and value == AUTO:
        return
    expected = 'an integer >= 1 or "auto"' if auto else "an integer >= 1"
    raise ConfigError(f"[{section}] {key} must be {expected}, got {toml_repr(value)}")


def _one_of(section: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if isinstance(value, str) and value in choices:
        return
    options = ", ".join(json.dumps(c) for c in choices)
    raise ConfigError(f"[{section}] {key} must be one of {options}, got {toml_repr(value)}")


# ----------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ClusterConfig:
    """``nodes`` and ``gpus_per_node`` (ranks per node); ``"auto"`` takes the launch's."""

    nodes: int | str
    gpus_per_node: int | str
    # for ``usp plan``'s step-time estimate: link bandwidths in GB/s per direction
    # ("auto": usp.planner.search.DEFAULT_INTRA_NODE_GBPS / DEFAULT_INTER_NODE_GBPS)
    intra_node_gbps: float | str = AUTO
    inter_node_gbps: float | str = AUTO
    # the accelerator's name, for ``usp plan``'s memory limit ("auto": H200)
    gpu: str = AUTO

    def __post_init__(self) -> None:
        _positive_int("cluster", "nodes", self.nodes, auto=True)
        _positive_int("cluster", "gpus_per_node", self.gpus_per_node, auto=True)
        for key in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, key)
            if value != AUTO and not (
                (is_int(value) or isinstance(value, float)) and 0 < value < float("inf")
            ):
                raise ConfigError(
                    f'[cluster] {key} must be a number > 0 (GB/s) or "auto", got {toml_repr(value)}'
                )
        if not (isinstance(self.gpu, str) and self.gpu):
            raise ConfigError(
                f'[cluster] gpu must be a name such as "H200", got {toml_repr(self.gpu)}'
            )

    @property
    def is_auto(self) -> bool:
        return AUTO in (self.nodes, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        """``nodes * gpus_per_node``; a :class:`ConfigError` when either is ``"auto"``."""
        if self.is_auto:
            raise ConfigError(
                f"[cluster] nodes = {toml_repr(self.nodes)}, gpus_per_node = "
                f"{toml_repr(self.gpus_per_node)}: the world size comes from the launch"
            )
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        """``"1 node x 4 ranks"`` (``"auto"`` where the launch decides)."""
        return describe_uniform_nodes(self.nodes, self.gpus_per_node)


@dataclass(frozen=True)
class ParallelConfig:
    ulysses: int | str
    ring: int | str
    dp: int | str = AUTO
    placement: str = ULYSSES_IN_NODE
    allow_cross_node_ulysses: bool = False

    def __post_init__(self) -> None:
        for key in ("ulysses", "ring", "dp"):
            _positive_int("parallel", key, getattr(self, key), auto=True)
        _one_of("parallel", "placement", self.placement, PLACEMENTS)
        if not isinstance(self.allow_cross_node_ulysses, bool):
            raise ConfigError(
                "[parallel] allow_cross_node_ulysses must be true or false, "
                f"got {toml_repr(self.allow_cross_node_ulysses)}"
            )


@dataclass(frozen=True)
class AttentionConfig:
    layout: str = "zigzag"
    ring_impl: str = "p2p"
    backend: str = "auto"

    def __post_init__(self) -> None:
        _one_of("attention", "layout", self.layout, LAYOUTS)
        _one_of("attention", "ring_impl", self.ring_impl, RING_IMPLS)
        _one_of("attention", "backend", self.backend, BACKENDS)


@dataclass(frozen=True)
class ModelConfig:
    num_heads: int
    num_kv_heads: int | None = None  # None: same as num_heads (multi-head attention)
    head_dim: int | None = None  # only used for byte estimates

    def __post_init__(self) -> None:
        _positive_int("model", "num_heads", self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive_int("model", "num_kv_heads", self.num_kv_heads)
        if self.head_dim is not None:
            _positive_int("model", "head_dim", self.head_dim)
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"[model] num_heads({self.num_heads}) is not a multiple of "
                f"num_kv_heads({self.num_kv_heads})"
            )


_SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "attention": AttentionConfig,
    "model": ModelConfig,
}
_REQUIRED_SECTIONS = ("cluster", "parallel")


def _keys_of(section: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(_SECTIONS[section]))


# Override name -> section, e.g. load_config(path, ulysses=4, nodes=2).
OVERRIDE_KEYS: dict[str, str] = {key: section for section in _SECTIONS for key in _keys_of(section)}


# ----------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class UspConfig:
    """One parsed config file. ``source`` (the path) prefixes every later error."""

    cluster: ClusterConfig
    parallel: ParallelConfig
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    model: ModelConfig | None = None
    source: str | None = None

    @property
    def is_resolved(self) -> bool:
        return all(is_int(getattr(self.parallel, k)) for k in ("ulysses", "ring", "dp"))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The TOML structure (sections -> keys), without ``source``."""
        sections = {name: getattr(self, name) for name in _SECTIONS}
        return {name: asdict(body) for name, body in sections.items() if body is not None}

    def with_overrides(self, **overrides: Any) -> UspConfig:
        return config_from_dict(self.to_dict(), source=self.source, **overrides)

    def resolve(
        self, world_size: int | None = None, *, launch: Launch | None = None
    ) -> ResolvedConfig:
        """Turn ``"auto"`` into numbers and validate everything through the rank math.

        Without ``launch`` (checking a file, ``usp topo``): ``world_size`` defaults to
        ``nodes * gpus_per_node``; a different world size keeps ``gpus_per_node`` as the
        ranks per node (so the node count changes). ``gpus_per_node = "auto"`` then
        needs a number from an override, and ``nodes = "auto"`` a ``world_size``.

        With the running job's ``launch``: the cluster must describe it (``"auto"``
        values take it), and the rank map uses the nodes observed, including uneven or
        interleaved ones.
        """
        try:
            if launch is not None:
                if world_size is not None and world_size != launch.world_size:
                    raise ConfigError(
                        f"world_size({world_size}) differs from the launch's "
                        f"{launch.world_size} ranks"
                    )
                check_cluster_matches_launch(self.cluster, launch)
                return _resolve(self, launch.world_size, launch.node_of_rank)
            return _resolve(self, _planned_world_size(self.cluster, world_size), None)
        except (TopologyError, HeadLayoutError, ConfigError) as e:
            raise ConfigError(_located(self.source, str(e))) from e


@dataclass(frozen=True)
class ResolvedConfig:
    """A config with numeric degrees, its world size, rank map and KV replication."""

    config: UspConfig
    world_size: int
    rank_map: RankMap
    kv_replication: int | None  # None without a [model] section

    @property
    def ulysses(self) -> int:
        return self.rank_map.ulysses_degree

    @property
    def ring(self) -> int:
        return self.rank_map.ring_degree

    @property
    def dp(self) -> int:
        return self.rank_map.dp_degree


def _located(source: str | None, message: str) -> str:
    if source is None or message.startswith(f"{source}: "):
        return message
    return f"{source}: {message}"


# ----------------------------------------------------------------------------- parsing
def load_config(path: str | os.PathLike, **overrides: Any) -> UspConfig:
    """Parse a TOML config; ``overrides`` (``ulysses=4``, ``nodes=2``, ...) replace keys.

    An override of ``None`` is ignored, so argparse results can be passed straight in.
    """
    source = os.fspath(path)
    return config_from_dict(read_toml(source), source=source, **overrides)


def read_toml(source: str) -> dict[str, Any]:
    """The TOML document at ``source``; every way that can fail is a :class:`ConfigError`."""
    try:
        with open(source, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # bounded: the path may be a device or a dataset
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read the config file: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: larger than {MAX_CONFIG_BYTES} bytes; a topology config is a small "
            "TOML file (see examples/configs/)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r}); "
            "TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML: nested too deeply") from None


def config_from_dict(
    data: dict[str, Any], *, source: str | None = None, **overrides: Any
) -> UspConfig:
    """Build a :class:`UspConfig` from the TOML structure (a dict of sections)."""
    try:
        data = _apply_overrides(data, overrides)
        _check_structure(data)
        sections = {name: _SECTIONS[name](**data[name]) for name in _SECTIONS if name in data}
    except ConfigError as e:
        raise ConfigError(_located(source, str(e))) from None
    return UspConfig(**sections, source=source)


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = {
        name: dict(value) if isinstance(value, dict) else value for name, value in data.items()
    }
    for key, value in overrides.items():
        if key not in OVERRIDE_KEYS:
            raise ConfigError(
                f"unknown override {key!r}; known overrides: {', '.join(OVERRIDE_KEYS)}"
            )
        if value is None:
            continue
        section = OVERRIDE_KEYS[key]
        if not isinstance(merged.get(section, {}), dict):
            continue  # _check_structure reports the malformed section
        merged.setdefault(section, {})[key] = value
    return merged


def _check_structure(data: dict[str, Any]) -> None:
    for name, body in data.items():
        if name not in _SECTIONS:
            raise ConfigError(
                f"unknown section [{name}]; expected {', '.join(f'[{s}]' for s in _SECTIONS)}"
            )
        if not isinstance(body, dict):
            raise ConfigError(f"{name} must be a [{name}] table, got {toml_repr(body)}")
        known = _keys_of(name)
        for key in body:
            if key not in known:
                raise ConfigError(
                    f"[{name}] unknown key {key!r}; expected one of {', '.join(known)}"
                )
        required = [f.name for f in fields(_SECTIONS[name]) if _is_required(f)]
        for key in required:
            if key not in body:
                raise ConfigError(f"[{name}] missing required key {key!r}")
    for name in _REQUIRED_SECTIONS:
        if name not in data:
            raise ConfigError(f"missing section [{name}] (with keys {', '.join(_keys_of(name))})")


def _is_required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


# ----------------------------------------------------------------------------- resolution
def _planned_world_size(cluster: ClusterConfig, world_size: int | None) -> int:
    """The world size to check a file against when there is no launch."""
    if cluster.gpus_per_node == AUTO:
        raise ConfigError(
            '[cluster] gpus_per_node = "auto" is taken from the launch; to check this '
            "config without one, give the ranks per node (usp topo --gpus-per-node N)"
        )
    if world_size is not None:
        return world_size
    if cluster.nodes == AUTO:
        raise ConfigError(
            '[cluster] nodes = "auto" is taken from the launch; to check this config '
            "without one, give the node count or the world size (usp topo --nodes N or "
            "--world-size N)"
        )
    return cluster.nodes * cluster.gpus_per_node


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
    config: UspConfig, world_size: int, node_of_rank: tuple[int, ...] | None
) -> ResolvedConfig:
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
    return ResolvedConfig(resolved, world_size, rank_map, kv)


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
    try:
        return kv_replication(model.num_heads, model.num_kv_heads, u)
    except HeadLayoutError as e:
        pairs = describe_valid_pairs(model.num_heads, model.num_kv_heads, sp, ranks_per_node)
        raise HeadLayoutError(
            f"[model] does not fit [parallel] ulysses = {u}: {e}; {pairs}"
        ) from None


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
    config: UspConfig, world_size: int, nodes: _NodeLayout
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
    config: UspConfig, world_size: int, nodes: _NodeLayout, *, ring: int | str, dp: int | str
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


# ----------------------------------------------------------------------------- launch
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
    import torch.distributed as dist

    from usp.process_groups.launch import can_observe_launch, observe_launch
    from usp.process_groups.topology import default_device_type, topology_from_rank_map

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
                _located(
                    config.source,
                    '[cluster] gpus_per_node = "auto" needs an observed launch; with emulated '
                    "nodes give the emulated node size",
                )
            )
        if cluster.nodes != AUTO and cluster.nodes * cluster.gpus_per_node != world_size:
            raise ConfigError(
                _located(
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

"""Topology config files (TOML): a cluster, parallel degrees, attention options, a model.

Format (see ``examples/configs/`` for commented files)::

    [cluster]
    nodes = 2
    gpus_per_node = 8             # = ranks per node

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

``"auto"`` is resolved by :meth:`UspConfig.resolve`:

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

from usp.process_groups.degrees import (
    HeadLayoutError,
    describe_valid_pairs,
    kv_replication,
    valid_degree_pairs,
)
from usp.process_groups.rank_math import (
    PLACEMENTS,
    ULYSSES_IN_NODE,
    RankMap,
    TopologyError,
    divisors,
    fitting_ulysses_degrees,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

AUTO = "auto"
LAYOUTS = ("zigzag", "contiguous")
RING_IMPLS = ("p2p", "allgather")
# "auto" plus usp.kernels' backend names (kept here so config parsing imports no kernels).
BACKENDS = ("auto", "cudnn", "flash", "efficient", "flash_attn", "cpu", "math")


class ConfigError(ValueError):
    """A config file (or its overrides) is malformed or does not fit the world."""


# ----------------------------------------------------------------------------- value checks
def _show(value: Any) -> str:
    """A value as the user wrote it in TOML: strings in double quotes, lowercase bools."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(section: str, key: str, value: Any, *, auto: bool = False) -> None:
    if _is_int(value) and value >= 1:
        return
    if auto and value == AUTO:
        return
    expected = 'an integer >= 1 or "auto"' if auto else "an integer >= 1"
    raise ConfigError(f"[{section}] {key} must be {expected}, got {_show(value)}")


def _one_of(section: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if isinstance(value, str) and value in choices:
        return
    options = ", ".join(json.dumps(c) for c in choices)
    raise ConfigError(f"[{section}] {key} must be one of {options}, got {_show(value)}")


# ----------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ClusterConfig:
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        _positive_int("cluster", "nodes", self.nodes)
        _positive_int("cluster", "gpus_per_node", self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


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
                f"got {_show(self.allow_cross_node_ulysses)}"
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
        return all(_is_int(getattr(self.parallel, k)) for k in ("ulysses", "ring", "dp"))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The TOML structure (sections -> keys), without ``source``."""
        data = {name: asdict(getattr(self, name)) for name in _SECTIONS}
        if self.model is None:
            del data["model"]
        return data

    def with_overrides(self, **overrides: Any) -> UspConfig:
        return config_from_dict(self.to_dict(), source=self.source, **overrides)

    def resolve(self, world_size: int | None = None) -> ResolvedConfig:
        """Turn ``"auto"`` into numbers and validate everything through the rank math.

        ``world_size`` defaults to ``nodes * gpus_per_node``; a different world size keeps
        ``gpus_per_node`` as the ranks per node (so the node count changes).
        """
        try:
            return _resolve(self, self.cluster.world_size if world_size is None else world_size)
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
    try:
        with open(source, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    return config_from_dict(data, source=source, **overrides)


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
            raise ConfigError(f"{name} must be a [{name}] table, got {_show(body)}")
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
def _resolve(config: UspConfig, world_size: int) -> ResolvedConfig:
    if not _is_int(world_size) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    ranks_per_node = config.cluster.gpus_per_node
    if world_size % ranks_per_node != 0:
        raise ConfigError(
            f"world_size({world_size}) is not a multiple of [cluster] gpus_per_node({ranks_per_node})"
        )
    u, r, d = _resolve_degrees(config, world_size)
    p = config.parallel
    try:
        rank_map = RankMap(
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            ulysses_degree=u,
            ring_degree=r,
            dp_degree=d,
            placement=p.placement,
            allow_cross_node_ulysses=p.allow_cross_node_ulysses,
        )
    except TopologyError as e:
        raise TopologyError(f"[parallel] {_config_wording(str(e))}") from None
    kv = _check_heads(config.model, u, r * u, ranks_per_node)
    resolved = replace(
        config,
        cluster=replace(config.cluster, nodes=world_size // ranks_per_node),
        parallel=replace(p, ulysses=u, ring=r, dp=d),
    )
    return ResolvedConfig(resolved, world_size, rank_map, kv)


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


def _resolve_degrees(config: UspConfig, world_size: int) -> tuple[int, int, int]:
    """``(ulysses, ring, dp)`` with every ``"auto"`` replaced (rules in the module doc)."""
    p = config.parallel
    u, r, d = p.ulysses, p.ring, p.dp
    if u == AUTO:
        u = _auto_ulysses(config, world_size, ring=r, dp=d)
    if r == AUTO:
        r = _exact(world_size, {"ulysses": u} if d == AUTO else {"ulysses": u, "dp": d})
    if d == AUTO:
        d = _exact(world_size, {"ring": r, "ulysses": u})
    return u, r, d


def _auto_ulysses(config: UspConfig, world_size: int, *, ring: int | str, dp: int | str) -> int:
    if ring != AUTO and dp != AUTO:
        return _exact(world_size, {"ring": ring, "dp": dp})
    if dp != AUTO:  # ring auto: Ulysses first, the ring takes the rest of sp
        sp_sizes = {u: world_size // dp for u in divisors(_exact(world_size, {"dp": dp}))}
    elif ring != AUTO:  # dp auto: Ulysses first, dp takes the rest of the world
        sp_sizes = {u: u * ring for u in divisors(_exact(world_size, {"ring": ring}))}
    else:  # both auto: sequence parallelism over the whole world
        sp_sizes = {u: world_size for u in divisors(world_size)}
    best = max(u for u, sp in sp_sizes.items() if _auto_candidate(config, world_size, u, sp))
    return best


def _auto_candidate(config: UspConfig, world_size: int, u: int, sp: int) -> bool:
    """Heads allow ``u`` and its Ulysses groups stay inside nodes (u=1 always passes)."""
    if sp % u != 0 or world_size % sp != 0:
        return False
    model = config.model
    heads = (model.num_heads, model.num_kv_heads) if model else (None, None)
    if u not in {pu for pu, _ in valid_degree_pairs(*heads, sp)}:
        return False
    fits = fitting_ulysses_degrees(
        sp, config.cluster.gpus_per_node, config.parallel.placement, world_size
    )
    return u in fits


# ----------------------------------------------------------------------------- launch
def build_topology_from_config(
    config_or_path: UspConfig | str | os.PathLike,
    *,
    device_type: str | None = None,
    **overrides: Any,
):
    """:func:`~usp.process_groups.topology.build_topology` from a config, after
    ``init_process_group``; every rank must call it.

    The running world size must equal ``nodes * gpus_per_node`` (the error prints both);
    ``gpus_per_node`` is the ranks per node.
    """
    import torch.distributed as dist

    from usp.process_groups.topology import build_topology

    if isinstance(config_or_path, UspConfig):
        config = config_or_path.with_overrides(**overrides) if overrides else config_or_path
    else:
        config = load_config(config_or_path, **overrides)
    world_size = dist.get_world_size()
    cluster = config.cluster
    if cluster.world_size != world_size:
        raise ConfigError(
            _located(
                config.source,
                f"[cluster] nodes({cluster.nodes}) * gpus_per_node({cluster.gpus_per_node}) = "
                f"{cluster.world_size} != world_size({world_size}) of the running job",
            )
        )
    resolved = config.resolve(world_size)
    p = resolved.config.parallel
    return build_topology(
        p.ulysses,
        p.ring,
        dp_degree=p.dp,
        ranks_per_node=cluster.gpus_per_node,
        device_type=device_type,
        placement=p.placement,
        allow_cross_node_ulysses=p.allow_cross_node_ulysses,
    )

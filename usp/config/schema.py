"""The topology sections of a config file and the :class:`UspConfig` that holds them.

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
    token_placement = "sequence"  # or "documents": short documents whole on one rank

    [attention]                   # optional
    layout = "zigzag"             # or "contiguous"
    ring_impl = "p2p"             # or "allgather"
    backend = "auto"              # or cudnn, flash, efficient, flash_attn, cpu, math
    linear_backend = "auto"       # Gated DeltaNet's recurrence: or torch, fla (CUDA, usp[fla])
    linear_conv_backend = "auto"  # its short conv: or torch, causal_conv1d (CUDA, usp[fla])

    [model]                       # optional: validates / chooses the Ulysses degree
    num_heads = 32
    num_kv_heads = 8              # default num_heads
    head_dim = 128                # optional, only for byte estimates

``[model]`` has one meaning per kind of file: in a topology config (this one) it gives
head counts; in a training config (``[data]`` and ``[train]`` present,
:mod:`usp.train.config`) it names the model to train (``path`` or ``preset`` with
``overrides``), whose own head counts are then used. A file that mixes the two is
refused with a message saying which keys belong where.

Every error is a :class:`ConfigError` naming the file and the ``[section] key``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from usp.config.fields import (
    apply_overrides,
    check_table,
    is_int,
    keys_of,
    override_keys,
    read_section,
)
from usp.config.resolve import resolve_config
from usp.config.sections import AttentionConfig, ClusterConfig, ModelConfig, ParallelConfig
from usp.config.toml import located, read_toml
from usp.errors import ConfigError, HeadLayoutError, TopologyError
from usp.process_groups.launch import Launch
from usp.process_groups.rank_math import RankMap

#: the sections of a topology config, in file order
SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "attention": AttentionConfig,
    "model": ModelConfig,
}
REQUIRED_SECTIONS = ("cluster", "parallel")
#: a training config's ``[model]`` keys (usp.train.config.ModelSection): what a
#: topology-only ``[model]`` refuses with a pointer to the training config
TRAINING_MODEL_KEYS = ("path", "preset", "overrides")

# Override name -> section, e.g. load_config(path, ulysses=4, nodes=2).
OVERRIDE_KEYS: dict[str, str] = override_keys(SECTIONS)


# ----------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class UspConfig:
    """One parsed topology config. ``source`` (the path) prefixes every later error."""

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
        sections = {name: getattr(self, name) for name in SECTIONS}
        return {name: asdict(body) for name, body in sections.items() if body is not None}

    def with_overrides(self, /, **overrides: Any) -> UspConfig:
        """The same file with ``overrides`` (``ulysses=4``, ...; None: not given)."""
        return _config_from(self.to_dict(), self.source, overrides)

    def with_heads(self, num_heads: int, num_kv_heads: int, head_dim: int | None) -> UspConfig:
        """This config with a ``[model]`` of these head counts (a model's real ones)."""
        data = self.to_dict()
        data["model"] = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        return config_from_dict(data, source=self.source)

    def resolve(
        self, world_size: int | None = None, *, launch: Launch | None = None
    ) -> ResolvedConfig:
        """Turn ``"auto"`` into numbers and validate everything through the rank math
        (the rules: :mod:`usp.config.resolve`).

        Without ``launch`` (checking a file: ``usp topo``, ``usp data``): ``world_size``
        defaults to ``nodes * gpus_per_node``; a different world size keeps
        ``gpus_per_node`` as the ranks per node (so the node count changes). An
        ``"auto"`` cluster value comes from the rest: the world size given, else the
        grid's own (``ulysses * ring * dp`` when ulysses and ring are numbers).

        With the running job's ``launch``: the cluster must describe it (``"auto"``
        values take it), and the rank map uses the nodes observed, including uneven or
        interleaved ones.
        """
        try:
            return ResolvedConfig(*resolve_config(self, world_size, launch))
        except (TopologyError, HeadLayoutError, ConfigError) as e:
            raise ConfigError(located(self.source, str(e))) from e


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


# ----------------------------------------------------------------------------- parsing
def load_config(path: str | os.PathLike, /, **overrides: Any) -> UspConfig:
    """Parse a TOML topology config; ``overrides`` (``ulysses=4``, ``nodes=2``, ...)
    replace keys.

    An override of ``None`` is ignored, so argparse results can be passed straight in.
    """
    source = os.fspath(path)
    return _config_from(read_toml(source), source, overrides)


def config_from_dict(
    data: dict[str, Any], /, *, source: str | None = None, **overrides: Any
) -> UspConfig:
    """Build a :class:`UspConfig` from the TOML structure (a dict of sections)."""
    return _config_from(data, source, overrides)


def _config_from(data: dict[str, Any], source: str | None, overrides: dict[str, Any]) -> UspConfig:
    """:func:`config_from_dict` with the overrides as a dict (any name is an override, so
    an unknown one is the one "unknown override" error, never a clash of parameters)."""
    try:
        data = apply_overrides(data, overrides, OVERRIDE_KEYS)
        _check_structure(data)
        sections = {name: read_section(name, SECTIONS[name], data[name]) for name in data}
    except ConfigError as e:
        raise ConfigError(located(source, str(e))) from None
    return UspConfig(**sections, source=source)


def _check_structure(data: dict[str, Any]) -> None:
    for name, body in data.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown section [{name}]; expected {', '.join(f'[{s}]' for s in SECTIONS)}"
            )
        if name == "model" and isinstance(body, dict):
            _refuse_training_model(body)
        check_table(name, SECTIONS[name], body)
    for name in REQUIRED_SECTIONS:
        if name not in data:
            raise ConfigError(
                f"missing section [{name}] (with keys {', '.join(keys_of(SECTIONS[name]))})"
            )


def _refuse_training_model(body: dict[str, Any]) -> None:
    """A topology config's ``[model]`` gives head counts, not a model to train."""
    training = [key for key in TRAINING_MODEL_KEYS if key in body]
    if training:
        raise ConfigError(
            f"[model] {training[0]} names a model to train, which only a training config "
            "(with [data] and [train] sections, run by usp train) reads; a topology config's "
            f"[model] gives head counts ({', '.join(keys_of(ModelConfig))})"
        )

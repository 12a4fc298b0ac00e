"""Training configs: the topology config plus ``[model]``, ``[data]`` and ``[train]``.

A training config is a TOML file::

    [cluster]      # as in usp.config: nodes, gpus_per_node
    [parallel]     # ulysses, ring, dp, placement, allow_cross_node_ulysses
    [attention]    # layout, ring_impl, backend (optional)

    [model]
    preset = "tiny"               # a usp.models.PRESETS name, randomly initialised; or
    # path = "/models/Llama-3.1-8B"  a local HF checkpoint directory (config.json, safetensors)
    # rope_theta, rope_scaling, max_position_embeddings: optional position settings
    # (context extension), for a checkpoint too; the architecture stays the config.json's
    [model.overrides]             # optional, presets only: the family config's fields
    num_hidden_layers = 2

    [data]
    source = "jsonl"              # or "synthetic" (a generated long-range retrieval task)
    files = ["train.jsonl"]       # jsonl: relative to this file's directory
    tokenizer = "auto"            # "auto", "byte" or a tokenizer.json path
    ...

    [train]
    steps = 100
    global_batch = 8              # sequences per optimizer step (all dp replicas)
    seq_len = 1024
    ...

    [eval]                        # optional: a held-out loss during training
    files = ["heldout.jsonl"]     # formats as [data] files; tokenised and packed the same way
    every = 50                    # steps between evaluations (and after the last step)
    # max_batches = 4             # at most this many batches of global_batch sequences

``[cluster]``, ``[parallel]`` and ``[attention]`` go to :func:`usp.config.config_from_dict`
(with the model's head counts as its ``[model]``, so ``ulysses = "auto"`` and the head
checks see the real model: :func:`usp.train.components.topology_config`). Here
``[model]`` names the model (``path`` or ``preset``); the head counts a topology-only
config gives there (``num_heads`` ...) are refused in a training config, and ``path`` /
``preset`` in a topology-only one. The file is read by :func:`usp.config.read_toml`,
every key checked by the validators of :mod:`usp.config.fields`, and the overrides
(:data:`OVERRIDE_KEYS`) are derived from the sections' fields. Every error is a :class:`~usp.config.ConfigError` that names
the file and the ``[section] key``. Paths are resolved relative to the config file.
The sections themselves (their fields and checks) are :mod:`usp.train.config_sections`'.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usp.config import (
    AUTO,
    ConfigError,
    UspConfig,
    apply_overrides,
    config_from_dict,
    keys_of,
    located,
    override_keys,
    read_section,
    read_toml,
)
from usp.config import ModelConfig as HeadCounts  # a topology-only file's [model]
from usp.config.overrides import (
    Setting,
    apply_settings,
    check_no_conflicts,
    located_in_settings,
    parse_setting,
)
from usp.config.schema import SECTIONS as TOPOLOGY_SCHEMA
from usp.train.config_sections import (  # the sections, also importable from here
    DATA_SOURCES,
    DEVICES,
    DTYPE_CHOICES,
    LONG_DOCUMENTS,
    REPORT_TO,
    DataSection,
    EvalSection,
    ModelSection,
    TrainSection,
)

TOPOLOGY_SECTIONS = ("cluster", "parallel", "attention")
TRAIN_SECTIONS = ("model", "data", "train")
OPTIONAL_SECTIONS = ("eval",)
__all__ = [
    "AUTO", "ConfigError", "DATA_SOURCES", "DEVICES", "DTYPE_CHOICES", "LONG_DOCUMENTS", "OVERRIDE_KEYS",
    "REPORT_TO", "DataSection", "EvalSection", "ModelSection", "TrainJobConfig", "TrainSection",
    "is_train_config", "load_train_config", "train_config_from_dict",
]  # fmt: skip

_SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "eval": EvalSection,
}
# Overrides (command-line flags, keyword arguments): every key of the topology sections,
# [data] and [train]; the model is named in the file. ([eval] is not among the flat names:
# its ``files`` would make [data]'s ambiguous.)
OVERRIDE_KEYS: dict[str, str] = override_keys(
    {
        **{name: TOPOLOGY_SCHEMA[name] for name in TOPOLOGY_SECTIONS},
        "data": DataSection,
        "train": TrainSection,
    }
)


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class TrainJobConfig:
    """A parsed training config. ``source`` (the path) prefixes every later error."""

    topology: UspConfig
    model: ModelSection
    data: DataSection
    train: TrainSection
    eval: EvalSection | None = None  # None: no [eval] section, no held-out loss
    source: str | None = None
    #: the TOML structure as written, with the applied overrides
    tables: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def error(self, message: str, kind: type[ConfigError] = ConfigError) -> ConfigError:
        """A :class:`ConfigError` (or the subclass ``kind``) located in this config's file."""
        return kind(f"{self.source}: {message}" if self.source else message)

    @property
    def config_dir(self) -> Path:
        return Path(self.source).resolve().parent if self.source else Path.cwd()

    def path(self, value: str) -> Path:
        """A path from the config, relative to the config file's directory."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.config_dir / p

    @property
    def output_dir(self) -> Path:
        if self.train.output_dir == AUTO:
            name = Path(self.source).stem if self.source else "usp_train"
            return Path("runs") / name
        return Path(self.train.output_dir).expanduser()

    def gradient_accumulation(self, dp: int) -> int:
        """Micro-batches per optimizer step on one dp replica; checks the batch sizes."""
        t = self.train
        per_step = dp * t.micro_batch
        if t.gradient_accumulation == AUTO:
            if t.global_batch % per_step:
                raise self.error(
                    f"[train] global_batch({t.global_batch}) is not a multiple of "
                    f"dp({dp}) * micro_batch({t.micro_batch}) = {per_step}"
                )
            return t.global_batch // per_step
        if per_step * t.gradient_accumulation != t.global_batch:
            raise self.error(
                f"[train] dp({dp}) * micro_batch({t.micro_batch}) * gradient_accumulation"
                f"({t.gradient_accumulation}) = {per_step * t.gradient_accumulation} "
                f"!= global_batch({t.global_batch})"
            )
        return t.gradient_accumulation

    def with_train(self, **changes: Any) -> TrainJobConfig:
        """This job with ``[train]`` fields changed as objects (checked by
        :class:`TrainSection`; nothing re-parsed), its tables updated to match."""
        train = dataclasses.replace(self.train, **changes)
        tables = {**self.tables, "train": {**self.tables.get("train", {}), **changes}}
        return dataclasses.replace(self, train=train, tables=tables)

    def with_overrides(self, /, **overrides: Any) -> TrainJobConfig:
        """The file re-read with ``overrides`` (any key of :data:`OVERRIDE_KEYS`:
        ``steps=3``, ``ulysses=4``, ...); ``None`` values are ignored (argparse defaults)."""
        return _train_config_from(self.tables, self.source, overrides)

    def topology_with_heads(self, num_heads: int, num_kv_heads: int, head_dim: int) -> UspConfig:
        """The topology config with the model's head counts as its ``[model]``, so
        ``ulysses = "auto"`` and the head checks see the real model."""
        return self.topology.with_heads(num_heads, num_kv_heads, head_dim)


def load_train_config(
    path: str | os.PathLike, /, *, sets: Sequence[str | Setting] = (), **overrides: Any
) -> TrainJobConfig:
    """Parse a training config file; ``sets``: ``--set SECTION.KEY=VALUE`` settings
    (:mod:`usp.config.overrides`), written into the file's structure before it is read;
    ``overrides`` as in :meth:`TrainJobConfig.with_overrides` (a key given by both is an
    error)."""
    source = os.fspath(path)
    settings = [parse_setting(s) if isinstance(s, str) else s for s in sets]
    data = read_toml(source)
    if not settings:
        return _train_config_from(data, source, overrides)
    try:
        check_no_conflicts(settings, overrides, OVERRIDE_KEYS, {"output_dir": "--output"})
        data = apply_settings(data, settings)
        return _train_config_from(data, source, overrides)
    except ConfigError as err:
        raise ConfigError(located(source, located_in_settings(str(err), settings))) from None


def train_config_from_dict(
    data: dict[str, Any], /, *, source: str | None = None, **overrides: Any
) -> TrainJobConfig:
    """Build a :class:`TrainJobConfig` from the TOML structure (a dict of sections)."""
    return _train_config_from(data, source, overrides)


def _train_config_from(
    data: dict[str, Any], source: str | None, overrides: dict[str, Any]
) -> TrainJobConfig:
    """:func:`train_config_from_dict` with the overrides as a dict (any name is an
    override: an unknown one is the "unknown override" error, never a parameter clash)."""
    try:
        data = apply_overrides(data, overrides, OVERRIDE_KEYS)
        known = TOPOLOGY_SECTIONS + TRAIN_SECTIONS + OPTIONAL_SECTIONS
        unknown = [name for name in data if name not in known]
        if unknown:
            expected = ", ".join(f"[{s}]" for s in known)
            raise ConfigError(f"unknown section [{unknown[0]}]; expected {expected}")
        sections = {name: _section(name, data) for name in TRAIN_SECTIONS}
        sections.update({name: _section(name, data) for name in OPTIONAL_SECTIONS if name in data})
    except ConfigError as e:
        raise ConfigError(located(source, str(e))) from None
    # The topology's [model] (head counts, checked against the Ulysses degree) comes from
    # the real model once its config is known (usp.train.components.topology_config).
    topology_data = {name: data[name] for name in TOPOLOGY_SECTIONS if name in data}
    topology = config_from_dict(topology_data, source=source)
    return TrainJobConfig(topology=topology, source=source, tables=data, **sections)


def _section(name: str, data: dict[str, Any]):
    cls = _SECTIONS[name]
    body = data.get(name)
    if body is None:
        if name == "data":
            raise ConfigError(
                'missing section [data] (source = "jsonl" with files, or "synthetic")'
            )
        raise ConfigError(f"missing section [{name}] (keys: {', '.join(keys_of(cls))})")
    if name == "model" and isinstance(body, dict):
        _refuse_head_counts(body)
    return read_section(name, cls, body)


def _refuse_head_counts(body: dict[str, Any]) -> None:
    """A training config's ``[model]`` names the model; its head counts come from it."""
    given = [key for key in keys_of(HeadCounts) if key in body]
    if given:
        raise ConfigError(
            f"[model] {given[0]}: a training config takes the head counts from the model it "
            "names (path or preset); remove " + ", ".join(given) + " (head counts in [model] "
            "belong to a topology-only config, without [data] and [train])"
        )


def is_train_config(data: dict[str, Any]) -> bool:
    """Whether a parsed TOML file is a training config (it has ``[train]`` or ``[data]``)."""
    return "train" in data or "data" in data

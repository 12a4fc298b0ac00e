"""Training configs: the topology config plus ``[model]``, ``[data]`` and ``[train]``.

A training config is a TOML file::

    [cluster]      # as in usp.config: nodes, gpus_per_node
    [parallel]     # ulysses, ring, dp, placement, allow_cross_node_ulysses
    [attention]    # layout, ring_impl, backend (optional)

    [model]
    preset = "tiny"               # a usp.models.PRESETS name, randomly initialised; or
    # path = "/models/Llama-3.1-8B"  a local HF checkpoint directory (config.json, safetensors)
    [model.overrides]             # optional, presets only: LlamaConfig fields
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

``[cluster]``, ``[parallel]`` and ``[attention]`` go to :func:`usp.config.config_from_dict`
(with the model's head counts as its ``[model]``, so ``ulysses = "auto"`` and the head
checks see the real model). Every error is a :class:`~usp.config.ConfigError` that names
the file and the ``[section] key``. Paths are resolved relative to the config file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from usp.config import ConfigError, UspConfig, config_from_dict, is_int, toml_repr

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

AUTO = "auto"
TOPOLOGY_SECTIONS = ("cluster", "parallel", "attention")
TRAIN_SECTIONS = ("model", "data", "train")
DATA_SOURCES = ("jsonl", "synthetic")
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


# ----------------------------------------------------------------------------- value checks
def _is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _fail(section: str, key: str, expected: str, value: Any) -> None:
    raise ConfigError(f"[{section}] {key} must be {expected}, got {toml_repr(value)}")


def _int(section: str, key: str, value: Any, *, minimum: int, auto: bool = False) -> None:
    if auto and value == AUTO:
        return
    if not (is_int(value) and value >= minimum):
        _fail(section, key, f"an integer >= {minimum}" + (' or "auto"' if auto else ""), value)


def _number(section: str, key: str, value: Any, *, minimum: float, strict: bool = False) -> None:
    ok = _is_number(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        _fail(section, key, f"a number {'>' if strict else '>='} {minimum}", value)


def _bool(section: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(section, key, "true or false", value)


def _choice(section: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not (isinstance(value, str) and value in choices):
        _fail(section, key, "one of " + ", ".join(json.dumps(c) for c in choices), value)


def _string(section: str, key: str, value: Any) -> None:
    if not (isinstance(value, str) and value):
        _fail(section, key, "a non-empty string", value)


# ----------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ModelSection:
    """Where the weights come from: a local HF directory, or a preset with random init."""

    path: str | None = None
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.preset is None):
            raise ConfigError(
                "[model] needs exactly one of path (a local HF checkpoint directory) or "
                'preset (e.g. "tiny"), got ' + ("both" if self.path is not None else "neither")
            )
        if self.path is not None:
            _string("model", "path", self.path)
        if self.preset is not None:
            _string("model", "preset", self.preset)
        if not isinstance(self.overrides, dict):
            _fail("model", "overrides", "a table of LlamaConfig fields", self.overrides)
        if self.overrides and self.path is not None:
            raise ConfigError(
                "[model] overrides only apply to a preset; a checkpoint's shape comes from "
                "its config.json"
            )


@dataclass(frozen=True)
class DataSection:
    """Where the training sequences come from and how documents are packed."""

    source: str = "jsonl"
    files: tuple[str, ...] = ()
    tokenizer: str = AUTO  # "auto": the model directory's tokenizer.json; "byte"; a path
    shuffle: bool = True
    # Each document is padded to a multiple of this before packing ("auto": what the
    # layout needs, 2*ring for zigzag). A fixed value makes the packed stream the same
    # for every topology whose need divides it (compare runs across degrees).
    document_multiple: int | str = AUTO
    synthetic_documents: int = 2048  # size of the generated data set
    synthetic_length: int = 40  # longest prompt of a generated document, in tokens

    def __post_init__(self) -> None:
        _choice("data", "source", self.source, DATA_SOURCES)
        files = self.files
        if isinstance(files, str):
            files = (files,)
        if not (isinstance(files, (list, tuple)) and all(isinstance(f, str) for f in files)):
            _fail("data", "files", "a path or a list of paths", self.files)
        object.__setattr__(self, "files", tuple(files))
        if self.source == "jsonl" and not self.files:
            raise ConfigError('[data] files is required when source = "jsonl"')
        if self.source == "synthetic" and self.files:
            raise ConfigError('[data] files is not used when source = "synthetic"; remove it')
        _string("data", "tokenizer", self.tokenizer)
        _bool("data", "shuffle", self.shuffle)
        _int("data", "document_multiple", self.document_multiple, minimum=1, auto=True)
        _int("data", "synthetic_documents", self.synthetic_documents, minimum=1)
        _int("data", "synthetic_length", self.synthetic_length, minimum=2)


@dataclass(frozen=True)
class TrainSection:
    """Optimisation, precision, intervals and where outputs go."""

    steps: int
    global_batch: int  # sequences per optimizer step, over all dp replicas
    seq_len: int  # tokens per packed sequence (global, before sequence parallelism)
    micro_batch: int = 1  # sequences per forward pass on one dp replica
    gradient_accumulation: int | str = AUTO  # "auto": global_batch / (dp * micro_batch)
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0
    dtype: str = AUTO  # compute dtype; "auto": bfloat16 on CUDA, float32 on CPU
    activation_checkpointing: bool = False
    checkpoint_interval: int = 0  # optimizer steps; 0: only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept in output_dir/checkpoints
    log_interval: int = 1  # steps between progress lines when no progress bar is shown
    export: bool = True  # write an HF checkpoint (output_dir/hf) at the end
    output_dir: str = AUTO  # "auto": runs/<config file name>
    device: str = AUTO  # "auto": cuda when available, else cpu
    peak_tflops: float | str = AUTO  # per device, for MFU; "auto": from the device name
    compile: bool = False  # torch.compile each decoder layer (usp.train.parallelize)

    def __post_init__(self) -> None:
        s = "train"
        for key in ("steps", "global_batch", "seq_len", "micro_batch", "keep_checkpoints"):
            _int(s, key, getattr(self, key), minimum=1)
        for key in ("warmup_steps", "seed", "checkpoint_interval"):
            _int(s, key, getattr(self, key), minimum=0)
        _int(s, "log_interval", self.log_interval, minimum=1)
        _int(s, "gradient_accumulation", self.gradient_accumulation, minimum=1, auto=True)
        _number(s, "lr", self.lr, minimum=0, strict=True)
        _number(s, "weight_decay", self.weight_decay, minimum=0)
        _number(s, "adam_eps", self.adam_eps, minimum=0, strict=True)
        _number(s, "grad_clip", self.grad_clip, minimum=0)
        if not (_is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            _fail(s, "min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        betas = self.adam_betas
        if not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in betas)
        ):
            _fail(s, "adam_betas", "two numbers in [0, 1), e.g. [0.9, 0.95]", betas)
        object.__setattr__(self, "adam_betas", tuple(float(b) for b in betas))
        _choice(s, "dtype", self.dtype, DTYPES)
        _choice(s, "device", self.device, DEVICES)
        _bool(s, "activation_checkpointing", self.activation_checkpointing)
        _bool(s, "export", self.export)
        _string(s, "output_dir", self.output_dir)
        if self.peak_tflops != AUTO:
            _number(s, "peak_tflops", self.peak_tflops, minimum=0, strict=True)
        _bool(s, "compile", self.compile)


_SECTIONS: dict[str, type] = {"model": ModelSection, "data": DataSection, "train": TrainSection}


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class TrainJobConfig:
    """A parsed training config. ``source`` (the path) prefixes every later error."""

    topology: UspConfig
    model: ModelSection
    data: DataSection
    train: TrainSection
    source: str | None = None
    #: the [cluster]/[parallel]/[attention] tables as written, plus applied overrides
    topology_data: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def error(self, message: str) -> ConfigError:
        """A :class:`ConfigError` located in this config's file."""
        return ConfigError(f"{self.source}: {message}" if self.source else message)

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

    def with_overrides(self, **overrides: Any) -> TrainJobConfig:
        """Command-line overrides; ``None`` values are ignored (argparse defaults)."""
        topo = {k: overrides.pop(k) for k in ("ulysses", "ring", "dp") if k in overrides}
        train = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(train) - {f.name for f in fields(TrainSection)}
        if unknown:
            raise ConfigError(f"unknown override(s) {sorted(unknown)}")
        try:
            section = replace(self.train, **train)
        except ConfigError as e:
            raise self.error(str(e)) from None
        data = {name: dict(body) for name, body in self.topology_data.items()}
        for key, value in topo.items():
            if value is not None:
                data.setdefault("parallel", {})[key] = value
        topology = config_from_dict(data, source=self.source)
        return replace(self, topology=topology, train=section, topology_data=data)

    def topology_with_heads(self, num_heads: int, num_kv_heads: int, head_dim: int) -> UspConfig:
        """The topology config with the model's head counts as its ``[model]``, so
        ``ulysses = "auto"`` and the head checks see the real model."""
        data = dict(self.topology_data)
        data["model"] = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        return config_from_dict(data, source=self.source)


def load_train_config(path: str | os.PathLike, **overrides: Any) -> TrainJobConfig:
    """Parse a training config file; ``overrides`` as in :meth:`TrainJobConfig.with_overrides`."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    job = train_config_from_dict(data, source=source)
    return job.with_overrides(**overrides) if overrides else job


def train_config_from_dict(data: dict[str, Any], *, source: str | None = None) -> TrainJobConfig:
    """Build a :class:`TrainJobConfig` from the TOML structure (a dict of sections)."""

    def located(message: str) -> ConfigError:
        return ConfigError(f"{source}: {message}" if source else message)

    unknown = [name for name in data if name not in TOPOLOGY_SECTIONS + TRAIN_SECTIONS]
    if unknown:
        expected = ", ".join(f"[{s}]" for s in TOPOLOGY_SECTIONS + TRAIN_SECTIONS)
        raise located(f"unknown section [{unknown[0]}]; expected {expected}")
    try:
        sections = {name: _section(name, data) for name in TRAIN_SECTIONS}
    except ConfigError as e:
        raise located(str(e)) from None
    except TypeError as e:  # a table where a value was expected, or the reverse
        raise located(str(e)) from None
    topology_data = {name: data[name] for name in TOPOLOGY_SECTIONS if name in data}
    # The topology config's [model] (head counts, checked against the Ulysses degree) is
    # filled from the real model once its config is known (topology_with_heads).
    topology = config_from_dict(topology_data, source=source)
    return TrainJobConfig(topology=topology, source=source, topology_data=topology_data, **sections)


def _section(name: str, data: dict[str, Any]):
    cls = _SECTIONS[name]
    body = data.get(name)
    if body is None:
        if name == "data":
            raise ConfigError(
                'missing section [data] (source = "jsonl" with files, or "synthetic")'
            )
        raise ConfigError(
            f"missing section [{name}] (keys: {', '.join(f.name for f in fields(cls))})"
        )
    if not isinstance(body, dict):
        raise ConfigError(f"{name} must be a [{name}] table, got {toml_repr(body)}")
    known = [f.name for f in fields(cls)]
    for key in body:
        if key not in known:
            raise ConfigError(f"[{name}] unknown key {key!r}; expected one of {', '.join(known)}")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in body:
            raise ConfigError(f"[{name}] missing required key {f.name!r}")
    return cls(**body)


def is_train_config(data: dict[str, Any]) -> bool:
    """Whether a parsed TOML file is a training config (it has ``[train]`` or ``[data]``)."""
    return "train" in data or "data" in data


def topology_config(path: str | os.PathLike) -> UspConfig:
    """The topology part of a training config, with the model's head counts as its
    ``[model]`` (what ``usp topo`` needs to check and show such a file)."""
    from usp.train.components import model_source

    job = load_train_config(path)
    config = model_source(job).config
    return job.topology_with_heads(
        config.num_attention_heads, config.num_key_value_heads, config.attention_head_dim
    )

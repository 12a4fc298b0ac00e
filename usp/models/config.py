"""The hyper-parameters of a decoder-only model family, read from and written to HF's
``config.json`` format.

:class:`DecoderConfig` holds what every family here shares (Llama's fields) and the
generic reading and writing; a family subclasses it (``usp/models/<family>.py``) with
its own fields (a bias, a sliding window) and class-level facts: its HF names, the
defaults transformers assumes for keys a ``config.json`` leaves out, and the keys whose
value is fixed. Only what changes the computation is kept; a config a family cannot
compute exactly (another architecture, another activation, dropout, ...) is an error
naming what is supported rather than a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from usp.errors import ModelConfigError  # noqa: F401 - re-exported here
from usp.models.hf_keys import installed_form
from usp.models.layer_kinds import FULL, SLIDING
from usp.models.rope_config import (
    NEEDS_ORIGINAL_CONTEXT,
    POSITION_FIELDS,
    RopeSettings,
    normalise_rope_scaling,
    rope_from_hf,
)

#: the fields every config.json must give (no family has a sensible default for them)
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
#: written by transformers for its own bookkeeping; never read back as model settings
_HF_BOOKKEEPING = ("transformers_version", "rope_parameters", "torch_dtype", "dtype")


@dataclass(frozen=True)
class DecoderConfig:
    """The shared hyper-parameters (HF ``config.json`` names).

    ``head_dim=None`` means ``hidden_size // num_attention_heads``. ``rope_scaling`` is
    ``None`` (plain RoPE) or a dict with ``rope_type`` one of ``linear``, ``llama3`` or
    ``yarn`` and that type's keys (:data:`usp.models.rope_config.ROPE_KEYS`), as in HF's
    ``config.json``. ``extra``: keys of the source config.json the model does not use,
    written back unchanged.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: as many as query heads (MHA)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------- the family's facts
    #: the registry name (``usp.models.family``)
    family: ClassVar[str] = ""
    #: HF ``architectures`` (the first is written) and ``model_type`` values
    architectures: ClassVar[tuple[str, ...]] = ()
    model_type: ClassVar[str] = ""
    #: what transformers' config class assumes for a key the config.json leaves out
    #: (where it differs from this dataclass's default), so a file reads as HF reads it
    hf_defaults: ClassVar[dict[str, Any]] = {}
    #: config.json keys with the one value this family computes (written on export)
    hf_fixed: ClassVar[dict[str, Any]] = {"hidden_act": "silu", "attention_dropout": 0.0}
    #: config fields besides the shared ones that decide parameter shapes
    shape_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in (*REQUIRED_KEYS, "num_key_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size({self.hidden_size}) is not divisible by num_attention_heads"
                f"({self.num_attention_heads}); give head_dim explicitly"
            )
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ModelConfigError(f"head_dim must be a positive even integer, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads({self.num_key_value_heads}) (grouped-query attention)"
            )
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        object.__setattr__(self, "rope_scaling", normalise_rope_scaling(self.rope_scaling))

    @property
    def attention_head_dim(self) -> int:
        """The size of one attention head (``head_dim`` or ``hidden_size // heads``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    # ---------------------------------------------------------------- the layers
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind in transformers' ``layer_types`` names
        (:mod:`usp.models.layer_kinds`): full attention everywhere unless the family
        says otherwise."""
        return (FULL,) * self.num_hidden_layers

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (keys at distance < window, computed exactly
        by USP attention at any length), None for full causal attention."""
        sliding = self.layer_kinds[index] == SLIDING
        return getattr(self, "sliding_window", None) if sliding else None

    @property
    def attention_window(self) -> int | None:
        """The sliding window some layer attends within, None when no layer slides."""
        windows = (self.layer_window(i) for i in range(self.num_hidden_layers))
        return next((w for w in windows if w is not None), None)

    def layer_rope(self, index: int) -> RopeSettings:
        """The RoPE layer ``index``'s attention rotates with (the same on every layer
        unless the family says otherwise)."""
        return RopeSettings(self.attention_head_dim, self.rope_theta, self.rope_scaling)

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)

    def layer_variants(self) -> list[tuple[DecoderConfig, int]]:
        """``(one-layer config, how many layers are like it)`` for each kind of decoder
        layer (parameter and FLOP counts build one layer of each kind)."""
        return [(self.replace(num_hidden_layers=1), self.num_hidden_layers)]

    def shape(self) -> dict[str, Any]:
        """What decides the parameters' shapes (checkpoints record and compare it)."""
        names = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "attention_head_dim",
            "tie_word_embeddings",
            *self.shape_fields,
        )
        return {"family": self.family, **{name: getattr(self, name) for name in names}}

    def with_positions(
        self,
        *,
        rope_theta: float | None = None,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> DecoderConfig:
        """This config with new position settings (context extension); ``None`` keeps a
        setting. ``rope_scaling = {"rope_type": "default"}`` removes the scaling. A
        ``llama3``/``yarn`` scaling without ``original_max_position_embeddings`` is
        measured against this config's ``max_position_embeddings`` (the context the
        weights were trained at)."""
        changes: dict[str, Any] = {}
        if rope_theta is not None:
            changes["rope_theta"] = rope_theta
        if max_position_embeddings is not None:
            changes["max_position_embeddings"] = max_position_embeddings
        if rope_scaling is not None:
            if not isinstance(rope_scaling, dict):
                raise ModelConfigError(
                    f"rope_scaling must be a table with a rope_type, got {rope_scaling!r}"
                )
            scaling = dict(rope_scaling)
            if scaling.get("rope_type", scaling.get("type")) in NEEDS_ORIGINAL_CONTEXT:
                scaling.setdefault("original_max_position_embeddings", self.max_position_embeddings)
            changes["rope_scaling"] = scaling
        return self.replace(**changes)

    def position_changes(self, other: DecoderConfig) -> list[str]:
        """``"name: old -> new"`` for each position setting ``other`` changes; a
        ModelConfigError if it changes anything else (the architecture)."""
        if type(other) is not type(self):
            raise ModelConfigError(
                f"the model family differs: {self.family} in the checkpoint, {other.family} asked"
            )
        differ = [
            f.name
            for f in dataclasses.fields(self)
            if f.compare and getattr(self, f.name) != getattr(other, f.name)
        ]
        fixed = [name for name in differ if name not in POSITION_FIELDS]
        if fixed:
            raise ModelConfigError(
                f"only {', '.join(POSITION_FIELDS)} may differ from the checkpoint's "
                f"config.json; {', '.join(fixed)} differ"
            )
        return [f"{name}: {getattr(self, name)} -> {getattr(other, name)}" for name in differ]

    # ------------------------------------------------------------------ HF format
    @classmethod
    def accepts(cls, config: dict[str, Any]) -> bool:
        """Whether an HF config dict names this family (architectures or model_type)."""
        archs = config.get("architectures") or []
        if archs:
            return bool(set(archs) & set(cls.architectures))
        return config.get("model_type") == cls.model_type

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        """Read an HF ``config.json`` dict of this family (transformers 4.x
        ``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``). ``source`` names the
        file in error messages."""
        if not cls.accepts(config):
            archs = config.get("architectures")
            given = (
                f"architecture {', '.join(map(str, archs))}"
                if archs
                else f"model_type {config.get('model_type')!r}"
            )
            raise ModelConfigError(
                f"{source}: {given} is not a {cls.family} model ({', '.join(cls.architectures)}"
                f", model_type {cls.model_type!r}); usp.models.from_pretrained and "
                "usp.models.config_from_hf read a checkpoint of any family usp has"
            )
        missing = [k for k in REQUIRED_KEYS if k not in config]
        if missing:
            raise ModelConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        for key, value in cls.hf_fixed.items():
            given = config.get(key, value)
            if given != value and not (key == "attention_dropout" and not given):
                raise ModelConfigError(
                    f"{source}: {key}={given!r} is not supported by usp's {cls.family} model; "
                    f"it computes {key}={value!r}"
                )
        cls.check_hf(config, source)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_theta", "rope_scaling"}
        values = {k: config[k] for k in names if k in config}
        for key, default in cls.hf_defaults.items():
            values.setdefault(key, default)
        theta, scaling = rope_from_hf(config, source)
        used = names | {"rope_theta", "rope_scaling", *cls.hf_fixed, *cls.hf_read_only()}
        extra = {k: v for k, v in config.items() if k not in used}
        try:
            return cls(**values, rope_theta=theta, rope_scaling=scaling, extra=extra)
        except ModelConfigError as err:
            raise ModelConfigError(f"{source}: {err}") from None

    @classmethod
    def check_hf(cls, config: dict[str, Any], source: str) -> None:
        """A family's own refusals of an HF config dict (e.g. a bias it cannot compute)."""

    @classmethod
    def hf_read_only(cls) -> tuple[str, ...]:
        """config.json keys a family checks (:meth:`check_hf`) but does not keep."""
        return ()

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """An HF ``config.json`` dict that transformers loads as this family.

        The keys are those the installed transformers writes (:mod:`usp.models.hf_keys`:
        ``rope_parameters`` and ``dtype`` on 5.x; ``rope_theta`` + ``rope_scaling`` and
        ``torch_dtype``, which every version reads, without transformers).
        """
        out = dict(self.extra)
        for key in _HF_BOOKKEEPING:
            out.pop(key, None)
        fields = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"
        }
        fields["head_dim"] = self.attention_head_dim
        if fields["rope_scaling"]:
            fields["rope_scaling"] = dict(fields["rope_scaling"])
        out.update(
            architectures=[self.architectures[0]],
            model_type=self.model_type,
            **fields,
            **self.hf_fixed,
        )
        if dtype is not None:
            out["torch_dtype"] = dtype
        return installed_form(out, source_keys=self.extra)  # the user's transformers' keys

    @classmethod
    def from_json_file(cls, path: str | Path) -> DecoderConfig:
        return cls.from_hf_dict(read_config_json(path), source=str(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of an HF ``config.json``, or a ModelConfigError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} must hold a JSON object")
    return data


#: how transformers writes a non-finite float in a config.json: ``{"__float__": "Infinity"}``
FLOAT_TAG = "__float__"


def read_hf_float(value):
    """A config.json value, transformers' tagged non-finite floats read as floats."""
    if isinstance(value, dict) and set(value) == {FLOAT_TAG}:
        tag = value[FLOAT_TAG]
        return float(tag) if tag in ("Infinity", "-Infinity", "NaN") else value
    return value


def hf_float(value: float):
    """A float as transformers writes it in a config.json (non-finite ones tagged)."""
    if math.isfinite(value):
        return value
    return {FLOAT_TAG: "NaN" if math.isnan(value) else ("-" if value < 0 else "") + "Infinity"}


def check_integers(config, minimums: dict[str, int]) -> None:
    """A ModelConfigError unless each named field of ``config`` is an integer >= its
    minimum."""
    for name, minimum in minimums.items():
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ModelConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_numbers(config, names: tuple[str, ...], *, positive: bool = False) -> None:
    """A ModelConfigError unless each named field of ``config`` is a finite number >= 0
    (> 0 with ``positive``)."""
    for name in names:
        value = getattr(config, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise ModelConfigError(
                f"{name} must be a number {'>' if positive else '>='} 0, got {value!r}"
            )


def check_routing(config, experts_field: str = "num_experts") -> None:
    """A mixture-of-experts config's router settings: ``num_experts_per_tok`` at most the
    experts (when there are any), ``router_aux_loss_coef`` a number >= 0."""
    experts, top_k = getattr(config, experts_field), config.num_experts_per_tok
    if experts and top_k > experts:
        raise ModelConfigError(
            f"num_experts_per_tok({top_k}) must be at most {experts_field}({experts})"
        )
    check_numbers(config, ("router_aux_loss_coef",))


def merge_alias(config: dict[str, Any], keep: str, alias: str, *, source: str) -> None:
    """Read ``config[alias]`` (a transformers ``attribute_map`` name) as ``config[keep]``,
    in place: the alias is removed; both present with different values is refused."""
    if alias not in config:
        return
    value = config.pop(alias)
    if config.setdefault(keep, value) != value:
        named = sorted([(keep, config[keep]), (alias, value)])
        raise ModelConfigError(
            f"{source}: {named[0][0]}({named[0][1]}) and {named[1][0]}({named[1][1]}) differ"
        )


#: scalar annotations :func:`check_field_types` checks, and what they take
_SCALARS = {
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": (
        "a number",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    ),
}


def check_field_types(config) -> None:
    """A ModelConfigError naming the first field of ``config`` (a dataclass) whose value
    is not of its annotated scalar type (``bool``, ``int``, ``float``, each optionally
    ``| None``): ``output_router_logits = "false"`` is a string, and truthy, so it would
    turn the auxiliary loss on."""
    for f in dataclasses.fields(config):
        kind = f.type.removesuffix(" | None") if isinstance(f.type, str) else None
        if kind not in _SCALARS:
            continue
        value = getattr(config, f.name)
        if value is None and f.type.endswith(" | None"):
            continue
        expected, fits = _SCALARS[kind]
        if not fits(value):
            optional = " or null" if f.type.endswith(" | None") else ""
            got = (
                f"the string {value!r} (write it without quotes)"
                if isinstance(value, str)
                else repr(value)
            )
            raise ModelConfigError(f"{f.name} must be {expected}{optional}, got {got}")

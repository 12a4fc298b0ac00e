"""The hyper-parameters of a Llama-3-family model, read from and written to HF's
``config.json`` format.

Only what changes the computation is kept; a config this model cannot compute exactly
(another architecture, biases, another activation, an unsupported RoPE scaling) is an
error naming what is supported rather than a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usp.errors import ModelConfigError  # noqa: F401 - re-exported here
from usp.models.hf_keys import installed_form

#: HF ``architectures`` / ``model_type`` values this model computes exactly
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("llama",)
#: RoPE variants computed exactly as transformers computes them (usp.models.rope)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: per RoPE type: (required keys, optional keys) of ``rope_scaling`` besides rope_type
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # linear does not use original_max_position_embeddings; it is accepted and kept
    "linear": (("factor",), ("original_max_position_embeddings",)),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}
#: the RoPE types that measure wavelengths against the pre-training context
NEEDS_ORIGINAL_CONTEXT = ("llama3", "yarn")
#: the fields a checkpoint's config may change (context extension); nothing else may
POSITION_FIELDS = ("rope_theta", "rope_scaling", "max_position_embeddings")


@dataclass(frozen=True)
class LlamaConfig:
    """Llama-3-family hyper-parameters (HF ``config.json`` names).

    ``head_dim=None`` means ``hidden_size // num_attention_heads``. ``rope_scaling`` is
    ``None`` (plain RoPE) or a dict with ``rope_type`` one of ``linear``, ``llama3`` or
    ``yarn`` and that type's keys (:data:`ROPE_KEYS`; e.g. ``{"rope_type": "llama3",
    "factor": ..., "low_freq_factor": ..., "high_freq_factor": ...,
    "original_max_position_embeddings": ...}``), as in HF's ``config.json``.
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
    #: keys of the source config.json this model does not use, written back unchanged
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ):
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
        object.__setattr__(self, "rope_scaling", _normalise_rope_scaling(self.rope_scaling))

    @property
    def attention_head_dim(self) -> int:
        """The size of one attention head (``head_dim`` or ``hidden_size // heads``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    def with_positions(
        self,
        *,
        rope_theta: float | None = None,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> LlamaConfig:
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

    def position_changes(self, other: LlamaConfig) -> list[str]:
        """``"name: old -> new"`` for each position setting ``other`` changes; a
        ModelConfigError if it changes anything else (the architecture)."""
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
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> LlamaConfig:
        """Read an HF ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling``
        or 5.x ``rope_parameters``). ``source`` names the file in error messages."""
        _check_architecture(config, source)
        for key, wrong in (("attention_bias", True), ("mlp_bias", True)):
            if config.get(key, False) is wrong:
                raise ModelConfigError(
                    f"{source}: {key}=true is not supported (Llama-3 has no biases); "
                    f"usp.models.Llama supports {key}=false"
                )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(
                f"{source}: hidden_act={act!r} is not supported; Llama uses 'silu'"
            )
        dropout = config.get("attention_dropout", 0.0) or 0.0
        if dropout:
            raise ModelConfigError(
                f"{source}: attention_dropout={dropout} is not supported (use 0)"
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_theta", "rope_scaling"}
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in config
        ]
        if missing:
            raise ModelConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        theta, scaling = _rope_from_hf(config, source)
        values = {k: config[k] for k in names if k in config}
        used = names | {"rope_theta", "rope_scaling", "rope_parameters"}
        extra = {k: v for k, v in config.items() if k not in used}
        try:
            return cls(**values, rope_theta=theta, rope_scaling=scaling, extra=extra)
        except ModelConfigError as err:
            raise ModelConfigError(f"{source}: {err}") from None

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """An HF ``config.json`` dict that ``transformers.LlamaForCausalLM`` loads.

        The keys are those the installed transformers writes (:mod:`usp.models.hf_keys`:
        ``rope_parameters`` and ``dtype`` on 5.x; ``rope_theta`` + ``rope_scaling`` and
        ``torch_dtype``, which every version reads, without transformers).
        """
        out = dict(self.extra)
        for key in ("transformers_version", "rope_parameters", "torch_dtype", "dtype"):
            out.pop(key, None)
        out.update(
            architectures=list(SUPPORTED_ARCHITECTURES),
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.attention_head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if dtype is not None:
            out["torch_dtype"] = dtype
        return installed_form(out, source_keys=self.extra)  # the user's transformers' keys

    @classmethod
    def from_json_file(cls, path: str | Path) -> LlamaConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(data, source=str(path))


def _check_architecture(config: dict[str, Any], source: str) -> None:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ModelConfigError(
            f"{source}: architecture {', '.join(map(str, archs))} is not supported by "
            f"usp.models.Llama; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)}). Other HF models that use "
            "transformers' AttentionInterface run under USP via usp.models.hf.register"
        )
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"{source}: model_type {model_type!r} is not supported by usp.models.Llama; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"({', '.join(SUPPORTED_ARCHITECTURES)}). Other HF models that use "
            "transformers' AttentionInterface run under USP via usp.models.hf.register"
        )
    if not archs and model_type is None:
        raise ModelConfigError(
            f"{source}: neither 'architectures' nor 'model_type' is set; expected "
            f"architectures [{SUPPORTED_ARCHITECTURES[0]!r}] or model_type 'llama'"
        )


def _rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either HF format."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"{source}: rope_parameters must be an object")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{source}: per-layer rope_parameters are not supported")
    scaling = dict(params or config.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or config.get("rope_theta") or 500000.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type in NEEDS_ORIGINAL_CONTEXT:  # as transformers reads these files
        scaling.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings", 8192)
        )
    return float(theta), scaling


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """``None`` for plain RoPE, else ``{"rope_type": ..., **its keys}``, every key known
    and every value checked (an unknown key would be an input silently dropped)."""
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ModelConfigError(f"rope_scaling must be a dict with a rope_type, got {scaling!r}")
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"rope_scaling rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    required, optional = ROPE_KEYS.get(rope_type, ((), ()))  # default: no keys
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ModelConfigError(f"{rope_type} rope_scaling is missing {', '.join(missing)}")
    unknown = sorted(set(scaling) - set(required) - set(optional))
    if unknown:
        raise ModelConfigError(
            f"{rope_type} rope_scaling has unknown key(s) {', '.join(unknown)}; it takes "
            + (", ".join((*required, *optional)) or "no other key")
        )
    if rope_type == "default":
        return None
    for key, value in scaling.items():
        _check_rope_value(rope_type, key, value)
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelConfigError(
            "llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
            f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}"
        )
    return {
        "rope_type": rope_type,
        **{k: scaling[k] for k in (*required, *optional) if k in scaling},
    }


def _check_rope_value(rope_type: str, key: str, value: Any) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "truncate":
        ok, expected = isinstance(value, bool), "true or false"
    elif key == "original_max_position_embeddings":
        ok = number and float(value).is_integer() and value >= 1
        expected = "a positive integer"
    elif key in ("mscale", "mscale_all_dim"):
        ok, expected = number and value >= 0, "a number >= 0"
    else:  # factor, low/high_freq_factor, attention_factor, beta_fast, beta_slow
        ok, expected = number and value > 0, "a number > 0"
    if not ok:
        raise ModelConfigError(f"{rope_type} rope_scaling {key} must be {expected}, got {value!r}")

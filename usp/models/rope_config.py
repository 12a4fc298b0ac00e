"""RoPE settings of an HF ``config.json``, read and checked: the one home of which RoPE
variants exist, which keys each takes and which config fields are position settings;
:class:`RopeSettings`, the rotation one layer's attention uses (what
:mod:`usp.models.rope` computes from).

Both HF formats are read: transformers 4.x ``rope_theta`` + ``rope_scaling``, 5.x
``rope_parameters``. Every key is known and every value checked: an unknown key would
be an input silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from usp.errors import ModelConfigError

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
#: the config fields a checkpoint's config may change (context extension), and the
#: ``[model]`` keys of a training config that set them; nothing else may change
POSITION_FIELDS = ("rope_theta", "rope_scaling", "max_position_embeddings")
#: transformers' ``default_theta`` (every family here): the theta of a config.json
#: that names none
HF_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeSettings:
    """The rotation a layer's attention applies, under the names :mod:`usp.models.rope`
    reads from a config: ``attention_head_dim`` rotated dims (fewer than the head's: a
    partial RoPE, the rest pass through), ``rope_theta`` and ``rope_scaling`` (None:
    plain RoPE; else normalised, :func:`normalise_rope_scaling`). Families with RoPE per
    layer type (Gemma 3's sliding layers) or on part of each head (Qwen3.5) give their
    own per layer (``DecoderConfig.layer_rope``)."""

    attention_head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None


def rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either HF format."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"{source}: rope_parameters must be an object")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{source}: per-layer rope_parameters are not supported")
    scaling = dict(params or config.get("rope_scaling") or {})
    if "partial_rotary_factor" in scaling or "partial_rotary_factor" in config:
        factor = scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor"))
        if factor not in (None, 1, 1.0):
            raise ModelConfigError(
                f"{source}: partial_rotary_factor={factor} is not supported (RoPE on every "
                "dim of a head); usp computes partial_rotary_factor = 1"
            )
    theta = scaling.pop("rope_theta", None) or config.get("rope_theta") or HF_DEFAULT_THETA
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type in NEEDS_ORIGINAL_CONTEXT:  # as transformers reads these files
        scaling.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings", 8192)
        )
    return float(theta), scaling


def normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
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

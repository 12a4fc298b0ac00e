"""Rotary position embeddings (RoPE): plain, and the context-extension variants of HF
``config.json`` files: ``linear`` (positions interpolated by ``factor``), ``llama3``
(Llama 3.1's frequency-dependent scaling) and ``yarn`` (NTK-by-parts interpolation plus
an attention scaling of cos/sin).

Each is computed as transformers computes it (the same formulas, in the same float32
order), so that a checkpoint sees the rotations it was trained with and the logits
equal ``transformers.LlamaForCausalLM``'s with the same ``rope_scaling``. The HF
checkpoint layout is used: a head's dims are split in halves ``(x1, x2)`` that rotate
together (``rotate_half``), not interleaved pairs. Angles are float32 as in Meta's and
HF's implementations; ``cos``/``sin`` are then cast to the activations' dtype.
"""

from __future__ import annotations

import math

import torch

from usp.models.config import DecoderConfig


def _plain_frequencies(config: DecoderConfig, device=None) -> torch.Tensor:
    """float32 [head_dim / 2]: theta ** -(2i / head_dim)."""
    dim = config.attention_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (config.rope_theta**exponents)


def inverse_frequencies(config: DecoderConfig, device=None) -> torch.Tensor:
    """float32 [head_dim / 2]: the rotation speed of each pair of dims."""
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "yarn":
        return _yarn_frequencies(config.attention_head_dim, config.rope_theta, scaling, device)
    inv_freq = _plain_frequencies(config, device)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scaling(inv_freq, scaling)


def attention_factor(config: DecoderConfig) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention scaling; 1 otherwise)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = (scaling.get(k) for k in ("factor", "mscale", "mscale_all_dim"))
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, the band in
    between interpolated smoothly (wavelengths measured against the original context)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(in_band, blended, slowed)


def _yarn_frequencies(dim: int, theta: float, scaling: dict, device=None) -> torch.Tensor:
    """YaRN (NTK-by-parts): dims that turn fewer than ``beta_slow`` times over the
    original context are interpolated (divided by ``factor``), dims that turn more than
    ``beta_fast`` times are kept, a linear ramp in between."""
    factor = scaling["factor"]
    context = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns this often over the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)  # [dim / 2]
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (plain frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [..., S] -> cos, sin [..., S, head_dim] in ``dtype``, both multiplied
    by ``scale`` (:func:`attention_factor`) in float32 before the cast."""
    angles = position_ids[..., None].float() * inv_freq.float()  # [..., S, D/2] float32
    angles = torch.cat([angles, angles], dim=-1)  # [..., S, D]: both halves rotate alike
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D], cos/sin [B or 1, S, D] -> x rotated, [B, S, H, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D]: broadcast over heads
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin

"""Rotary position embeddings (RoPE), plain and with Llama 3.1's frequency scaling.

The HF checkpoint layout is used: a head's dims are split in halves ``(x1, x2)`` that
rotate together (``rotate_half``), not interleaved pairs. Angles are computed in float32
as in Meta's and HF's implementations, so that a checkpoint sees the same rotations it
was trained with; ``cos``/``sin`` are then cast to the activations' dtype.
"""

from __future__ import annotations

import math

import torch

from usp.models.config import LlamaConfig


def inverse_frequencies(config: LlamaConfig, device=None) -> torch.Tensor:
    """float32 [head_dim / 2]: the rotation speed of each pair of dims."""
    dim = config.attention_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scaling(inv_freq, config.rope_scaling)


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


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [..., S] -> cos, sin [..., S, head_dim] in ``dtype``."""
    angles = position_ids[..., None].float() * inv_freq.float()  # [..., S, D/2] float32
    angles = torch.cat([angles, angles], dim=-1)  # [..., S, D]: both halves rotate alike
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D], cos/sin [B or 1, S, D] -> x rotated, [B, S, H, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D]: broadcast over heads
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin

"""Which keys each query row sees, under the masking semantics of ``spec.py``.

Backends that build explicit masks (``math``, ``cpu`` with a window) and code that
fixes up rows with no visible key share these helpers, so the semantics live in one place.
"""

from __future__ import annotations

import torch


def visible_key_bounds(
    seqlen_q: int, seqlen_k: int, causal: bool, window: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive bounds ``lo[i] <= j <= hi[i]`` of the keys row i sees; empty when lo > hi."""
    aligned = torch.arange(seqlen_q, device=device) + (seqlen_k - seqlen_q)  # [Sq]
    hi = aligned.clamp(max=seqlen_k - 1) if causal else torch.full_like(aligned, seqlen_k - 1)
    lo = (aligned - window).clamp(min=0) if window is not None else torch.zeros_like(aligned)
    return lo, hi


def visibility_mask(
    seqlen_q: int, seqlen_k: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``[Sq, Sk]``, True where visible; None when every key is visible."""
    if not causal and window is None:
        return None
    lo, hi = visible_key_bounds(seqlen_q, seqlen_k, causal, window, device)
    keys = torch.arange(seqlen_k, device=device)
    return (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])


def rows_without_keys(
    seqlen_q: int, seqlen_k: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``[Sq]`` of rows that see no key; None when there are none."""
    if seqlen_k == 0:
        return torch.ones(seqlen_q, dtype=torch.bool, device=device)
    if not causal and window is None:
        return None
    lo, hi = visible_key_bounds(seqlen_q, seqlen_k, causal, window, device)
    empty = lo > hi
    return empty if bool(empty.any()) else None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE and partial results are kept in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """A row with lse = -inf saw no key; +inf makes exp(s - lse) = 0 there instead of NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))

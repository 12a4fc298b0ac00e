"""Which keys each query row sees, under the masking semantics of ``spec.py``.

Backends that build explicit masks (``math``, ``cpu`` with a window) and the dispatcher,
which cuts off rows that see no key, share these helpers, so the semantics live in one
place. Everything here is shape arithmetic on Python ints or device-side tensor ops: no
host synchronisation.
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


def empty_row_count(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """How many rows see no key; they are always the first ones.

    Row i sits at key position p = i + Sk - Sq and sees keys max(0, p - window) ..
    (p if causal else Sk - 1). A left window never empties a row (p - window <= p and
    p <= Sk - 1), so only causality does, for the rows with p < 0: the first Sq - Sk rows
    when Sq > Sk. With no keys at all, every row is empty.
    """
    if seqlen_k == 0:
        return seqlen_q
    return max(0, seqlen_q - seqlen_k) if causal else 0


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE and partial results are kept in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """A row with lse = -inf saw no key; +inf makes exp(s - lse) = 0 there instead of NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))

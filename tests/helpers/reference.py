"""Single-process reference attention, written independently of ``usp.kernels``.

Plain softmax attention with repeated K/V heads and an explicit boolean mask, in
whatever dtype it is given (tests use float64), differentiated by autograd.
"""

from __future__ import annotations

import torch


def reference_mask(seqlen_q: int, seqlen_k: int, causal: bool, window: int | None) -> torch.Tensor:
    """True where query i may see key j; bottom-right aligned (row i sits at i + Sk - Sq)."""
    rows = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k)[None, :]
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        mask &= cols <= rows
    if window is not None:
        mask &= cols >= rows - window
    return mask


def reference_attention(q, k, v, *, causal=False, window=None, scale=None, mask=None):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq]).

    ``mask`` ([Sq, Sk] bool) overrides causal/window, e.g. for document masks.
    Rows that see no key give out = 0 and lse = -inf.
    """
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is None:
        mask = reference_mask(q.shape[1], k.shape[1], causal, window)
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = ~torch.isneginf(lse)  # rows that see no key; NaN rows stay NaN
    probs = torch.where(
        seen[..., None], torch.softmax(scores.masked_fill(~seen[..., None], 0.0), -1), 0.0
    )
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def document_mask(cu_seqlens: list[int], causal: bool) -> torch.Tensor:
    """Block-diagonal [T, T] mask of a packed sequence (causal inside each document)."""
    total = cu_seqlens[-1]
    doc = torch.zeros(total, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        doc[a:b] = i
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool).tril()
    return mask


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| over finite entries (NaN in actual -> inf)."""
    actual = actual.double()
    expected = expected.double()
    if torch.isnan(actual).any():
        return float("inf")
    both_inf = torch.isinf(expected) & (actual == expected)
    diff = (actual - expected).masked_fill(both_inf, 0.0).abs().max().item()
    scale = expected.masked_fill(torch.isinf(expected), 0.0).abs().max().item()
    return diff / max(scale, 1e-30)


def reference_sink_attention(q, k, v, sinks, *, causal=False, window=None, scale=None, mask=None):
    """:func:`reference_attention` with attention sinks: one extra softmax column per
    query head holding the logit ``sinks[h]`` (as transformers' gpt-oss eager attention),
    dropped after the softmax. Returns out [B, Sq, H, D]."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is None:
        mask = reference_mask(q.shape[1], k.shape[1], causal, window)
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def window_document_mask(cu_seqlens: list[int], window: int | None) -> torch.Tensor:
    """Causal block-diagonal [T, T] mask in which query i of a document sees keys
    i-window+1 .. i of it (transformers' ``sliding_window``); None: full causal."""
    mask = document_mask(cu_seqlens, True)
    if window is not None:
        pos = torch.arange(cu_seqlens[-1])
        mask &= pos[None, :] > pos[:, None] - window
    return mask

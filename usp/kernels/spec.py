"""Validation of attention calls, and the description of a call that backends inspect.

Shapes (the flash-attn convention):
    q      [B, Sq, H,   D]        k, v  [B, Sk, Hkv, D]        H % Hkv == 0
    out    [B, Sq, H,   D]        lse   [B, H, Sq] float32
Varlen (packed) calls drop the batch dim: q [Tq, H, D], k/v [Tk, Hkv, D], lse [H, Tq].

Masking semantics, shared by every backend. Query row i sits at the aligned key
position ``p = i + Sk - Sq`` (bottom-right alignment, as flash-attn >= 2.1). Key j is
visible when ``j <= p`` (if causal) and ``j >= p - window`` (if a left window is set).
For Sq == Sk this is the usual square causal mask. A row that sees no key gets
out = 0 and lse = -inf, so merging it with other blocks is a no-op.

Non-finite inputs follow IEEE arithmetic, as the float64 reference does: a NaN in a
query row makes that row's out and lse NaN (if it sees any key); a NaN in a key or
value reaches every row that sees it (a NaN value may also reach rows that do not see
it, through 0 * NaN in P @ V). A row whose every visible score is -inf (an infinite
key) gets lse = -inf, like a row that sees nothing, so merges ignore that block.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from usp.errors import AttentionInputError, BackendUnavailableError  # noqa: F401 - re-exported here


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a backend needs to decide whether it supports a call."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    window: int | None
    varlen: bool = False

    @property
    def square(self) -> bool:
        return self.seqlen_q == self.seqlen_k


def _check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise AttentionInputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise AttentionInputError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise AttentionInputError(f"{name} must be a floating-point tensor, got {x.dtype}")


def validate_inputs(
    q, k, v, *, causal: bool, window: int | None, varlen: bool = False
) -> AttentionSpec:
    """Check q/k/v and options; return the call's spec. Raises AttentionInputError."""
    ndim, layout = (
        (3, "[tokens, heads, head_dim]") if varlen else (4, "[batch, seq, heads, head_dim]")
    )
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, ndim, layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionInputError(
            f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise AttentionInputError(
            f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if k.shape != v.shape:
        raise AttentionInputError(
            f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    if not varlen and q.shape[0] != k.shape[0]:
        raise AttentionInputError(
            f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise AttentionInputError(
            f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}"
        )
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise AttentionInputError(
            f"the number of query heads ({heads}) must be a multiple of the number of "
            f"key/value heads ({kv_heads})"
        )
    if not isinstance(causal, bool):
        raise AttentionInputError(f"causal must be a bool, got {causal!r}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 0
    ):
        raise AttentionInputError(f"window must be None or an int >= 0, got {window!r}")
    seq_dim = 0 if varlen else 1
    return AttentionSpec(
        batch=1 if varlen else q.shape[0],
        seqlen_q=q.shape[seq_dim],
        seqlen_k=k.shape[seq_dim],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=q.shape[-1],
        dtype=q.dtype,
        device=q.device,
        causal=causal,
        window=window,
        varlen=varlen,
    )


def validate_backward_inputs(dout, out, lse, q, *, varlen: bool = False) -> None:
    """Check the extra tensors of a backward call against q (already validated)."""
    for name, x in (("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor) or x.shape != q.shape:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise AttentionInputError(f"{name} must have q's shape {tuple(q.shape)}, got {shape}")
        if x.dtype != q.dtype or x.device != q.device:
            raise AttentionInputError(
                f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
                f"got ({x.dtype}, {x.device})"
            )
    if varlen:
        expected = (q.shape[1], q.shape[0])
        what = "[heads, tokens]"
    else:
        expected = (q.shape[0], q.shape[2], q.shape[1])
        what = "[batch, heads, seq]"
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != expected:
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise AttentionInputError(f"lse must be {what} = {expected}, got {shape}")
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lse.dtype != lse_dtype or lse.device != q.device:
        raise AttentionInputError(
            f"lse must be {lse_dtype} on {q.device} for {q.dtype} inputs, got {lse.dtype} on {lse.device}"
        )


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale of a call: ``head_dim**-0.5`` for None, else the given number,
    which must be a finite real > 0 (NaN, inf, 0, negatives, bools and tensors are
    refused: a NaN scale would come back as rows of zeros from some kernels)."""
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise AttentionInputError(
            "softmax_scale must be a positive finite float (or None for head_dim**-0.5), "
            f"got {softmax_scale!r} of type {type(softmax_scale).__name__}"
        )
    value = float(softmax_scale)
    if not math.isfinite(value) or value <= 0:
        raise AttentionInputError(
            "softmax_scale must be a positive finite float (or None for head_dim**-0.5), "
            f"got {value!r}"
        )
    return value


def validate_cu_seqlens(cu_seqlens, total: int, name: str) -> list[int]:
    """Check cumulative document boundaries; return them as a Python list.

    Valid: a 1-D int32 tensor [0, ..., total], non-decreasing (empty documents allowed).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise AttentionInputError(
            f"{name} must be an int32 tensor, got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise AttentionInputError(f"{name} must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise AttentionInputError(
            f"{name} must be 1-D with at least 2 entries [0, ..., total], got shape {tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise AttentionInputError(f"{name} must start at 0, got {bounds[0]}")
    steps = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(step < 0 for step in steps):
        where = next(i for i, step in enumerate(steps) if step < 0)
        raise AttentionInputError(
            f"{name} must be non-decreasing, but entry {where + 1} ({bounds[where + 1]}) < "
            f"entry {where} ({bounds[where]})"
        )
    if bounds[-1] != total:
        raise AttentionInputError(
            f"{name} must end at the number of tokens ({total}), got {bounds[-1]}"
        )
    return bounds

"""Kimi Delta Attention test helpers: global inputs and a one-process float64 reference
built from parts that are not the code under test (``F.conv1d`` with zero padding per
document, and the recurrence token by token with a decay per key channel, as
transformers' ``recurrent_kimi_delta_attention`` writes it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_inputs(batch, seq_len, hk, heads, dk, dv, kernel, seed=0, dtype=torch.float64):
    """q, k [B, S, Hk, dk], v [B, S, H, dv], g (<= 0) [B, S, H, dk], beta (0..1)
    [B, S, H], the conv weights (wq, wk, wv) and an output gradient."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = randn(batch, seq_len, hk, dk), randn(batch, seq_len, hk, dk)
    v = randn(batch, seq_len, heads, dv)
    g = -torch.rand(batch, seq_len, heads, dk, generator=gen, dtype=dtype) * 1.5
    beta = torch.rand(batch, seq_len, heads, generator=gen, dtype=dtype)
    ws = [randn(c, kernel) * 0.5 for c in (hk * dk, hk * dk, heads * dv)]
    dout = randn(batch, seq_len, heads, dv)
    return [q, k, v, g, beta], ws, dout


def recurrent_kda(q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """The recurrence token by token: q, k [B, L, Hk, dk] (value head e reads key head
    e // (H / Hk)), v [B, L, H, dv], g [B, L, H, dk], beta [B, L, H] -> o [B, L, H, dv]."""
    heads = v.shape[2]
    q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    if use_qk_l2norm:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    state = q.new_zeros(q.shape[0], heads, q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]  # each key channel's row decays
        remembered = (state * k[:, t, :, :, None]).sum(-2)  # S^T k
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1)


def reference_kda(q, k, v, g, beta, ws, cu_seqlens=None, activation="silu", scale=None,
                  use_qk_l2norm=True):  # fmt: skip
    """Conv (when ``ws``) and recurrence per document, one process."""
    seq_len = v.shape[1]
    bounds = [0, seq_len] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        qd, kd, vd = q[:, a:b], k[:, a:b], v[:, a:b]
        if ws is not None:
            x = torch.cat([t.flatten(2) for t in (qd, kd, vd)], -1).transpose(1, 2)
            w = torch.cat(ws, 0)
            y = F.conv1d(x, w[:, None], padding=w.shape[1] - 1, groups=x.shape[1])[..., : b - a]
            y = (F.silu(y) if activation == "silu" else y).transpose(1, 2)
            parts = y.split([qd[0, 0].numel(), kd[0, 0].numel(), vd[0, 0].numel()], -1)
            qd, kd, vd = (p.unflatten(-1, t.shape[2:]) for p, t in zip(parts, (qd, kd, vd)))
        outs.append(recurrent_kda(qd, kd, vd, g[:, a:b], beta[:, a:b], scale, use_qk_l2norm))
    return torch.cat(outs, dim=1)

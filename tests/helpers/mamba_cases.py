"""Mamba-2 test helpers: global inputs and a one-process float64 reference built from parts
that are not the code under test (``F.conv1d`` with zero padding per document, and the
recurrence token by token, as transformers' ``mamba2_selective_state_update`` writes it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba_inputs(batch, seq_len, heads, groups, head_dim, state, kernel, *, seed=0,
                 dtype=torch.float64, bias=True):  # fmt: skip
    """x [B, S, H, P], b, c [B, S, G, N], dt (> 0) [B, S, H], a (< 0) and d [H], the conv
    weight [H P + 2 G N, K] and bias, and an output gradient."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x = randn(batch, seq_len, heads, head_dim)
    b, c = randn(batch, seq_len, groups, state), randn(batch, seq_len, groups, state)
    dt = F.softplus(randn(batch, seq_len, heads) - 1)
    a = -torch.rand(heads, generator=gen, dtype=dtype) * 2 - 0.1
    d = randn(heads)
    channels = heads * head_dim + 2 * groups * state
    weight = randn(channels, kernel) * 0.5
    conv_bias = randn(channels) * 0.3 if bias else None
    dout = randn(batch, seq_len, heads, head_dim)
    return [x, b, c, dt, a, d, weight, conv_bias], dout


def reference_mamba2(x, b, c, dt, a, d, weight, bias, cu_seqlens=None, activation="silu"):
    """Conv and recurrence per document, one process: y [B, S, H, P]."""
    seq_len, heads = x.shape[1], x.shape[2]
    groups, state = b.shape[2], b.shape[3]
    bounds = [0, seq_len] if cu_seqlens is None else [int(t) for t in cu_seqlens]
    outs = []
    for lo, hi in zip(bounds, bounds[1:]):
        xbc = torch.cat([t[:, lo:hi].flatten(2) for t in (x, b, c)], -1).transpose(1, 2)
        y = F.conv1d(xbc, weight[:, None], bias, padding=weight.shape[1] - 1,
                     groups=xbc.shape[1])[..., : hi - lo]  # fmt: skip
        y = (F.silu(y) if activation == "silu" else y).transpose(1, 2)
        xd, bd, cd = y.split([heads * x.shape[3], groups * state, groups * state], -1)
        xd = xd.unflatten(-1, (heads, -1))
        bd, cd = (t.unflatten(-1, (groups, state)).repeat_interleave(heads // groups, 2)
                  for t in (bd, cd))  # fmt: skip
        s = x.new_zeros(x.shape[0], heads, x.shape[3], state)  # [B, H, P, N] as HF keeps it
        steps = []
        for t in range(hi - lo):
            da = torch.exp(dt[:, lo + t] * a)  # [B, H]
            s = (
                s * da[..., None, None]
                + (dt[:, lo + t, :, None] * xd[:, t])[..., None] * bd[:, t, :, None]
            )
            steps.append((s * cd[:, t, :, None]).sum(-1) + d[:, None] * xd[:, t])
        outs.append(torch.stack(steps, 1))
    return torch.cat(outs, dim=1)

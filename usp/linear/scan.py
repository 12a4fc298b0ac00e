"""A linear recurrence with one scalar decay per head and token, in torch (chunked): the
scan of Mamba-2's state space duality (SSD), in the form fla calls simple GLA.

Per head, with a state ``S`` of [d_k, d_v] (Mamba-2: d_k the state size N, d_v the head
dim P), for every token t::

    S <- exp(g_t) S + k_t v_t^T
    o_t = S^T q_t

Mamba-2 maps onto it with q = C, k = B (its groups expanded to heads), v = dt x and
g = dt A (:mod:`usp.linear.mamba2`). The chunked form (chunk length c, gamma = cumsum(g)
inside the chunk)::

    O   = (Q K^T * exp(gamma_t - gamma_s) [s <= t]) V + diag(exp(gamma)) Q S0
    S_c = exp(gamma_c) S0 + K^T diag(exp(gamma_c - gamma)) V

Every factor but the last two lines is computed for all chunks at once; the loop over
chunks is two matmuls a chunk. Every exponent is <= 0 (g <= 0), so nothing overflows.
Autograd gives the backward.

Rows are independent segments in the padded layout of :func:`usp.linear.kernel.to_padded`
([N, L, H, D], zeros after a row's end): a zero key with g = 0 leaves the state as it was,
so a row's final state is exact whatever its padding. Precision: float64 computes in
float64, everything else in float32 (the caller casts; no casts here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["scalar_decay_padded"]


def scalar_decay_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked recurrence on independent rows from a zero state, in the compute dtype
    already (q scaled by the caller when it is to be).

    q, k [N, L, H, dk]; v [N, L, H, dv]; g (log decay, <= 0) [N, L, H]. Returns
    (o [N, L, H, dv], final state [N, H, dk, dv]). ``chunk_size`` is bounded by L (a
    longer chunk only pads the rows with [C, C] work, for the same result)."""
    n, length, heads, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(chunk_size, length))
    pad = (-length) % c
    if pad:  # zero keys and g = 0 after the end: the state is left as it was
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad))
    chunks = (length + pad) // c

    def chunked(t):  # [N, L, H, ..] -> [N, H, n_chunks, C, ..]
        return t.transpose(1, 2).reshape(n, heads, chunks, c, *t.shape[3:])

    q, k, v, g = (chunked(t) for t in (q, k, v, g))
    gamma = g.cumsum(-1)  # [N, H, n, C]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    inner = ((q @ k.transpose(-1, -2)) * decay) @ v  # [N, H, n, C, dv]: from a zero state
    q_decay = q * gamma.exp()[..., None]  # reads the chunk's start state
    k_tail = k * (gamma[..., -1:] - gamma).exp()[..., None]  # exp(gamma_C - gamma_s) k_s
    increments = k_tail.transpose(-1, -2) @ v  # [N, H, n, dk, dv]: each chunk from zero
    last = gamma[..., -1].exp()  # [N, H, n]

    state = q.new_zeros(n, heads, dk, dv)
    outs = []
    # unbind, not index: the backward of one select per chunk fills a whole zero tensor
    for inner_i, q_i, inc_i, last_i in zip(
        *(t.unbind(2) for t in (inner, q_decay, increments, last))
    ):
        outs.append(inner_i + q_i @ state)
        state = last_i[..., None, None] * state + inc_i
    o = torch.stack(outs, dim=2).reshape(n, heads, chunks * c, dv)[:, :, :length]
    return o.transpose(1, 2), state

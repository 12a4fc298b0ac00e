"""Mamba-1's selective scan (Jamba's): a linear recurrence with a diagonal decay per
channel and state, in torch, and a rank's ring block of it.

Per channel d and state n, for every token t (x after the conv, dt after softplus)::

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] x_t[d] B_t[n]
    y_t[d]    = sum_n h_t[d, n] C_t[n]            (+ D[d] x_t[d], added by the caller)

Every step multiplies the state elementwise: a segment's map from its start state is
``h_end = a * h_start + b`` with a = exp(A * sum(dt)) and b the state reached from zero,
both [D, N]: the ring design of the other linear mixers with a diagonal map
(:mod:`usp.linear.ring`), and each token adds ``exp(A * cumsum(dt)_t) h_start`` read by
``C_t``. The torch kernel is a two-level scan: the chunks' states from zero, all chunks at
once, step by step inside a chunk (``chunk_size`` steps); then the chunks' maps composed
in order (one step a chunk) and each token's start-state term added. Every exponent is
<= 0 (A < 0, dt >= 0). It holds every token's state ([rows, L, D, N], as transformers'
torch path does). Precision: float64 stays float64, everything else computes in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from usp.linear.block import RingPeers
from usp.linear.kernel import compute_dtype, from_padded, segment_rows, to_padded
from usp.linear.ring import Segments, compose_in_chunk_order
from usp.ring.documents import Documents

__all__ = ["SelectiveScanOptions", "diagonal_scan_padded", "selective_scan_ring_block"]


def diagonal_scan_padded(x, dt, a, b, c, *, chunk_size: int = 64):
    """The scan on independent rows from a zero state, in the compute dtype already.

    x, dt [R, L, D]; a [D, N]; b, c [R, L, N] (rows zero past their ends: dt = 0 leaves a
    state as it was). Returns (y [R, L, D] without the D skip, the final states
    [R, D, N])."""
    rows, length, channels = x.shape
    size = max(1, min(chunk_size, length))
    pad = (-length) % size
    if pad:
        x, dt, b, c = (F.pad(t, (0, 0, 0, pad)) for t in (x, dt, b, c))
    chunks = (length + pad) // size

    def chunked(t):  # [R, L, ..] -> [R, n, C, ..]
        return t.reshape(rows, chunks, size, *t.shape[2:])

    x, dt, b, c = (chunked(t) for t in (x, dt, b, c))
    log_decay = dt[..., None] * a  # [R, n, C, D, N]: <= 0
    increments = (dt * x)[..., None] * b[..., None, :]  # [R, n, C, D, N]
    state = x.new_zeros(rows, chunks, channels, a.shape[1])
    local = []  # every chunk's states from zero, all chunks at once
    for decay_i, inc_i in zip(log_decay.exp().unbind(2), increments.unbind(2)):
        state = decay_i * state + inc_i
        local.append(state)
    states = torch.stack(local, dim=2)  # [R, n, C, D, N]
    cumulative = log_decay.cumsum(2)  # [R, n, C, D, N]: the decay since the chunk's start
    start = x.new_zeros(rows, channels, a.shape[1])
    starts = []
    for total_i, final_i in zip(cumulative[:, :, -1].exp().unbind(1), states[:, :, -1].unbind(1)):
        starts.append(start)
        start = total_i * start + final_i
    states = states + cumulative.exp() * torch.stack(starts, dim=1)[:, :, None]
    y = torch.einsum("rncdk,rnck->rncd", states, c).reshape(rows, chunks * size, channels)
    return y[:, :length], start


@dataclass(frozen=True)
class SelectiveScanOptions:
    chunk_size: int


def selective_scan_ring_block(x, dt, a, b, c, d, documents: Documents, ring: RingPeers,
                              options: SelectiveScanOptions):  # fmt: skip
    """The scan and the D skip on a rank's ring block (channel-local): x, dt [B, S/r, D]
    (this rank's channels), a [D, N], b, c [B, S/r, N], d [D] or None. Returns
    y [B, S/r, D] in the compute dtype."""
    batch = x.shape[0]
    segments = Segments(documents, ring.rank)
    rows, valid, _ = segment_rows(segments.bounds)
    dtype = compute_dtype(x.dtype)
    xp, dtp, bp, cp = (to_padded(t.to(dtype), rows, valid) for t in (x, dt, b, c))
    a = a.to(dtype)
    y, final = diagonal_scan_padded(xp, dtp, a, bp, cp, chunk_size=options.chunk_size)
    if documents.chunks_per_doc > 1:  # chunks of one document follow one another
        elapsed = dtp.cumsum(1)  # [R, L, D]: sum of dt since the segment's start
        decay = (elapsed[:, -1, :, None] * a).exp()  # [R, D, N]: the segment's product
        maps = torch.cat([final, decay], dim=-1)  # [R, D, 2N]
        every = ring.gather(maps.reshape(batch, segments.count, *maps.shape[1:]))
        n = a.shape[1]
        zero = every[0, :, : segments.num_docs, :, :n] * 0  # in the graph on every rank
        s0 = compose_in_chunk_order(
            every, segments, zero, lambda m, state: m[..., n:] * state + m[..., :n]
        ).flatten(0, 1)  # [R, D, N]: each segment's start state
        y = y + torch.einsum("rldk,rlk,rdk->rld", (elapsed[..., None] * a).exp(), cp, s0)
    if d is not None:
        y = y + d.to(dtype) * xp
    return from_padded(y, valid, batch)

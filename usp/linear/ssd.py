"""The head-local part of a Mamba-2 layer under the ring: a rank's ring block ([B, S/r, h, ..]
after the Ulysses all-to-all) through the causal conv and the SSD scan, exact, with the
ring's two all-gathers (the conv tails, the segments' state maps).

Per segment (one chunk of one document, :mod:`usp.linear.ring`) the scan runs from a zero
state (:mod:`usp.linear.scan_backends`), giving the outputs ``o0`` and the state ``B`` it
reaches; with the decay product ``a = exp(sum g)`` of the segment (one scalar per head)
the segment's map is ``S_end = a S_start + B``. One all-gather of every segment's
(B, a) over the ring; every rank composes them in chunk order into its segments' start
states S0 (:func:`usp.linear.ring.scalar_start_states`) and adds each token's
``exp(gamma_t) C_t^T S0`` (gamma: the cumulative decay inside the segment). No extra
columns in the kernel: the decay is a scalar.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.linear.block import ConvCall, RingPeers, conv_segments
from usp.linear.kernel import compute_dtype, from_padded, segment_rows, to_padded
from usp.linear.ring import Segments, scalar_start_states
from usp.linear.scan_backends import ScanKernel
from usp.ring.documents import Documents

__all__ = ["SsdOptions", "ssd_ring_block"]


@dataclass(frozen=True)
class SsdOptions:
    conv: ConvCall  # this rank's channels (x, then B, then C)
    groups: int  # this rank's B/C groups (repeated when u does not divide them)
    state_size: int  # N
    chunk_size: int
    kernel: ScanKernel  # the scan's (usp.linear.scan_backends)


def ssd_ring_block(x, dt, a, d, documents: Documents, ring: RingPeers, options: SsdOptions):
    """Conv, scan and D skip on a rank's ring block (head-local).

    ``x`` [B, S/r, h * P + 2 * g * N] (the conv's inputs: this rank's heads' x, then its
    groups' B and C), ``dt`` [B, S/r, h] (the time step, after softplus and limits), ``a``
    [h] (A = -exp(A_log) of these heads), ``d`` [h] or None (the skip). Returns
    y [B, S/r, h, P] = SSD(x, dt, A, B, C) + D x (x after the conv) in the compute dtype."""
    batch = x.shape[0]
    heads = dt.shape[2]
    segments = Segments(documents, ring.rank)
    rows, valid, _ = segment_rows(segments.bounds)
    dtype = compute_dtype(x.dtype)
    y = conv_segments(x.to(dtype), options.conv, segments, ring, rows, valid)  # [B*N, L, C]
    dtp = to_padded(dt.to(dtype), rows, valid)  # [B*N, L, h]: zeros past a segment's end
    group_channels = options.groups * options.state_size
    xs, b, c = y.split([y.shape[-1] - 2 * group_channels, group_channels, group_channels], -1)
    xs = xs.unflatten(-1, (heads, -1))  # [B*N, L, h, P]
    b, c = (t.unflatten(-1, (options.groups, options.state_size)) for t in (b, c))
    b, c = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (b, c))  # groups -> heads
    g = dtp * a.to(dtype)  # [B*N, L, h]: log decay, 0 past a segment's end
    v = xs * dtp[..., None]
    lengths = [hi - lo for lo, hi in zip(segments.bounds, segments.bounds[1:])] * batch
    o, final = options.kernel.run(c, b, v, g, lengths=lengths, chunk_size=options.chunk_size,
                                  io_dtype=x.dtype)  # fmt: skip
    if documents.chunks_per_doc > 1:  # chunks of one document follow one another
        gamma = g.cumsum(1)  # [B*N, L, h]
        decay = gamma[:, -1].exp()  # the segment's product (g = 0 past its end)
        maps = torch.cat([final.flatten(2), decay[..., None]], dim=-1)  # [B*N, h, dk*dv + 1]
        every = ring.gather(maps.reshape(batch, segments.count, *maps.shape[1:]))
        s0 = scalar_start_states(every, segments).flatten(0, 1).unflatten(-1, final.shape[2:])
        o = o + gamma.exp()[..., None] * torch.einsum("nlhk,nhkv->nlhv", c, s0)
    if d is not None:
        o = o + d.to(dtype)[:, None] * xs
    return from_padded(o, valid, batch)

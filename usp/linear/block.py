"""The head-local part of a Gated DeltaNet layer under the ring: a rank's ring block
([B, S/r, h, D] after the Ulysses all-to-all) through the short conv and the gated delta
rule, exact, with the ring's two all-gathers (the conv tails, the segments' state maps;
see :mod:`usp.linear.ring`). :func:`usp.linear.gated_deltanet_usp` calls
:func:`ring_block` eagerly; under ``torch.compile`` :mod:`usp.linear.compiled` calls it
inside one opaque op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.linear.backends import GdnKernel
from usp.linear.conv import ConvKernel
from usp.linear.kernel import compute_dtype, from_padded, l2norm, segment_rows, to_padded
from usp.linear.ring import Segments, conv_contexts, ring_all_gather, segment_tails, start_states
from usp.ring.documents import Documents

__all__ = ["BlockOptions", "ConvCall", "RingPeers", "conv_segments", "ring_block"]


@dataclass(frozen=True)
class RingPeers:
    group: object  # the ring's process group (None: a ring of one)
    stats: object  # the CommStats the all-gathers count in
    rank: int

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..] -> [r, ..]: every ring rank's (zigzag with r = 1: this rank's)."""
        return x[None] if self.group is None else ring_all_gather(x, self.group, self.stats)


@dataclass(frozen=True)
class ConvCall:
    """A causal depthwise conv of a rank's channels: weight [C, K], bias [C] or None,
    its kernel (:mod:`usp.linear.conv`), activation (None or "silu") and the activations'
    dtype (what the kernel may run in)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: ConvKernel
    activation: str | None
    io_dtype: torch.dtype


def conv_segments(x: torch.Tensor, conv: ConvCall, segments: Segments, ring: RingPeers,
                  rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The conv of a rank's ring block x [B, S/r, C] (compute dtype) per segment, each
    reading the last ``K - 1`` inputs of its document before it (one all-gather of the
    segments' tails over the ring; zeros at a document's start) -> [B * N, L, C] in the
    padded layout of ``rows`` / ``valid`` (:func:`usp.linear.kernel.segment_rows`; values
    past a segment's end are not zero)."""
    batch = x.shape[0]
    x_pad = to_padded(x, rows, valid)  # [B*N, L, C]
    width = conv.weight.shape[1] - 1
    if segments.documents.chunks_per_doc == 1 or width == 0:
        context = x_pad.new_zeros(x_pad.shape[0], width, x_pad.shape[2])
    else:
        tails = segment_tails(x_pad, segments, batch, width)  # [B, N, K-1, C]
        every = ring.gather(tails)  # [r, B, N, K-1, C]
        context = conv_contexts(every, segments, width).flatten(0, 1)
    return conv.kernel.run(x_pad, conv.weight, context, conv.activation, io_dtype=conv.io_dtype,
                           bias=conv.bias)  # fmt: skip


@dataclass(frozen=True)
class BlockOptions:
    activation: str | None
    scale: float | None
    use_qk_l2norm: bool
    chunk_size: int
    kernel: GdnKernel  # the recurrence's (usp.linear.backends)
    conv: ConvKernel | None  # the short conv's (usp.linear.conv), None without one


def ring_block(tensors, documents: Documents, ring: RingPeers, ws, options: BlockOptions):
    """The conv and the recurrence on a rank's ring block (head-local): q, k
    [B, S/r, hk, dk], v [B, S/r, h, dv], g, beta [B, S/r, h] -> [B, S/r, h, dv]."""
    q, k, v, g, beta = tensors
    batch, _, hk, dk = q.shape
    heads, dv = v.shape[2:]
    segments = Segments(documents, ring.rank)
    chained = documents.chunks_per_doc > 1  # a document's chunks follow one another
    chunk = options.chunk_size

    rows, valid, _ = segment_rows(segments.bounds)
    dtype = compute_dtype(v.dtype)
    mask = valid.repeat(batch, 1).to(v.device)[..., None, None]  # [B*N, L, 1, 1]
    if ws is not None:
        x = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1).to(dtype)  # [B, S/r, C]
        conv = ConvCall(torch.cat(ws, 0), None, options.conv, options.activation, v.dtype)
        y = conv_segments(x, conv, segments, ring, rows, valid)  # [B*N, L, C]
        qp, kp, vp = y.split([hk * dk, hk * dk, heads * dv], dim=-1)
        qp, kp = (t.unflatten(-1, (hk, dk)) for t in (qp, kp))
        vp = vp.unflatten(-1, (heads, dv))
    else:
        qp, kp, vp = (to_padded(t.to(dtype), rows, valid) for t in (q, k, v))
    gp, bp = (to_padded(t.to(dtype), rows, valid) for t in (g, beta))
    qp, kp = (t.repeat_interleave(heads // hk, dim=2) for t in (qp, kp))
    if options.use_qk_l2norm:
        qp, kp = l2norm(qp), l2norm(kp)
    qp = qp * (dk**-0.5 if options.scale is None else options.scale)
    qp, kp, vp = (t * mask for t in (qp, kp, vp))  # the conv wrote past the segments' ends

    lengths = [b - a for a, b in zip(segments.bounds, segments.bounds[1:])] * batch

    def recurrence(vp, initial_state):  # the kernel's rows: [B*N, L, h, ..]
        return options.kernel.run(
            qp, kp, vp, gp, bp, lengths=lengths, initial_state=initial_state,
            chunk_size=chunk, io_dtype=v.dtype,
        )  # fmt: skip

    if not chained:
        o, _ = recurrence(vp, None)
    else:
        n = qp.shape[0]
        eye = torch.eye(dk, dtype=dtype, device=v.device).expand(n, heads, dk, dk)
        start = torch.cat([eye.new_zeros(n, heads, dk, dv), eye], dim=-1)  # [0 | I]
        vp = torch.cat([vp, vp.new_zeros(*vp.shape[:3], dk)], dim=-1)
        o, maps = recurrence(vp, start)
        maps = maps.reshape(batch, segments.count, *maps.shape[1:])
        every = ring.gather(maps)  # [r, B, N, h, dk, dv + dk]
        s0 = start_states(every, segments, dv).flatten(0, 1)  # [B*N, h, dk, dv]
        o = o[..., :dv] + torch.einsum("nlhk,nhkv->nlhv", o[..., dv:], s0)
    return from_padded(o, valid, batch).to(v.dtype)

"""Short windows on the p2p ring: a neighbour exchange of K/V tails instead of whole
blocks, for every layout whose window is shorter than the chunks it reads across.

With the kernels' left window w shorter than a chunk (every document's chunk when
documents are packed), a query chunk sees only its own keys and the last w keys of the
chunk before it in the same document (:func:`usp.ring.window.chunk_pair` with delta 1),
which a neighbouring rank holds (or, for zigzag's rank r-1, the rank itself). So instead
of rotating blocks every rank, with a :class:`Tails` plan:

- posts each :class:`TailMessage`: the rows of its K/V that a neighbour reads (the last w
  rows of every document of one piece), sent ``hops`` ranks along the ring (+1 the next
  rank, -1 the previous), all messages at once;
- computes its ``own`` blocks against its own K/V (the call's kernels: dense, or packed
  varlen and per-document calls) while they travel, then each message's blocks (dense
  calls, one per document) against the tails it received, merging by LSE;
- in the backward sends the tails again, and returns the float32 dK/dV of the tails it
  received to their owners (``-hops``), who add them at the rows they sent.

The geometry is :mod:`usp.ring.zigzag_tails` (dense zigzag) and
:mod:`usp.ring.packed_tails` (packed documents, both layouts). Messages across the ring's
ends carry keys nobody reads: they are sent so that every rank's messages have the same
shapes. With r = 2 both messages of a pass go between the same two ranks and match in
the order they are posted, which is the same on both.

Compiled (dense zigzag; packed tails stay eager), each message is a functional shift of
the graph (:mod:`usp.comm.traced`), posted in the same order on every rank. A rank that
never reads a message (ranks 0 and r-1 under zigzag) would drop its shift from its graph
alone, and the neighbour posting it would wait forever: every received tail ends in an
opaque copy of an output (:func:`usp.comm.traced.copy_after`: the LSE's forward, dK's
backward), as in the p2p ring. The backward's K/V and its tails' dK/dV buffers are tied
to the incoming gradient (:func:`usp.comm.traced.stack_after`), so that their shifts
stay in the backward on every rank (else a zero dK/dV of a tail nobody reads depends on
nothing of the backward, and that rank alone would send it from its forward graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.comm import traced
from usp.comm.ring_exchange import RingExchange, TracedRingExchange
from usp.kernels import merge_into
from usp.kernels.masks import accumulation_dtype
from usp.ring.calls import calls_for
from usp.ring.config import PreparedRing
from usp.ring.kv_message import start_pair
from usp.ring.layout import Block


@dataclass(frozen=True)
class TailMessage:
    """One message of a pass: the row ranges of this rank's block it sends (one per
    document, in message order), where (``hops``), and this rank's blocks against the
    message it receives from ``-hops`` ranks away (key rows: rows of that message; empty
    when it reads nothing from there)."""

    hops: int
    ranges: tuple[tuple[int, int], ...]
    blocks: tuple[Block, ...]

    @property
    def rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


@dataclass(frozen=True)
class Tails:
    """One rank's tail exchange: its blocks against its own K/V and its messages."""

    own: tuple[Block, ...]
    messages: tuple[TailMessage, ...]


def _row_index(cfg: PreparedRing, index: int, message: TailMessage, device) -> torch.Tensor:
    """int64 [rows] on the device: the rows a message of several ranges sends, made
    once per batch (packed) or shape (dense) and kept with the placement."""
    key = ("tails", cfg.window, index)
    rows = cfg.placement.windows.get(key)
    if rows is None:
        parts = [torch.arange(start, stop) for start, stop in message.ranges]
        rows = cfg.placement.windows[key] = torch.cat(parts).to(device)
    return rows


def _send(ring: RingExchange, k, v, cfg: PreparedRing, index: int, message: TailMessage):
    """Post ``message``'s rows of k and v ([2, B, rows, Hkv, D], no copy of the whole
    block)."""
    if len(message.ranges) == 1:
        start, stop = message.ranges[0]
        tails = torch.stack([k[:, start:stop], v[:, start:stop]])
    else:
        rows = _row_index(cfg, index, message, k.device)
        tails = torch.stack([k.index_select(1, rows), v.index_select(1, rows)])
    return start_pair(ring, tails, cfg.kv_dims, hops=message.hops)


def _add_returned(own, cfg: PreparedRing, index: int, message: TailMessage, grads) -> None:
    """own [2, B, L, Hkv, D] += ``grads`` [2, B, rows, ...] at the rows ``message`` sent."""
    if len(message.ranges) == 1:
        start, stop = message.ranges[0]
        own[:, :, start:stop] += grads
    else:
        own.index_add_(2, _row_index(cfg, index, message, own.device), grads)


def _exchange(cfg: PreparedRing):
    """Posted on the group (eager), or the graph's functional shifts (compiled)."""
    if torch.compiler.is_compiling():
        return TracedRingExchange(cfg.peers)
    return RingExchange(cfg.group, cfg.stats)


def _anchor(anchors: list, tail: torch.Tensor) -> None:
    """Compiled: keep one element of a received tail, read or not (for copy_after)."""
    if torch.compiler.is_compiling():
        anchors.append(traced.anchor(tail))


def tails_forward(q, k, v, cfg: PreparedRing, plan: Tails):
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> out [B, L, H, D], lse [B, H, L] (float32)."""
    ring = _exchange(cfg)
    acc = accumulation_dtype(q.dtype)
    pending = [_send(ring, k, v, cfg, i, m) for i, m in enumerate(plan.messages)]
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device
    )
    # its own blocks while the tails travel, then each tail's as it arrives
    forward_blocks(calls_for(cfg, cfg.placement.piece_docs), plan.own, q, k, v, out, lse)
    dense = calls_for(cfg, None)
    anchors = []
    for message, request in zip(plan.messages, pending):
        tail = request.wait()  # [2, B, rows, Hkv, D]
        _anchor(anchors, tail)
        forward_blocks(dense, message.blocks, q, tail[0], tail[1], out, lse)
    if anchors:  # compiled: every shift stays in this rank's graph
        lse = traced.copy_after(lse, lse.dtype, anchors)
    return out.to(q.dtype), lse


def forward_blocks(calls, blocks, q, keys, values, out, lse) -> None:
    """Merge ``blocks`` of q [B, L, H, D] against keys/values [B, rows, Hkv, D] into the
    float32 out [B, L, H, D] and lse [B, H, L]."""
    for b in blocks:
        block_out, block_lse = calls.forward(
            q[:, b.q_rows], keys[:, b.kv_rows], values[:, b.kv_rows], b.causal, b.window,
            b.delta,
        )  # fmt: skip
        merge_into(out[:, b.q_rows], lse[:, :, b.q_rows], block_out, block_lse)


def backward_blocks(calls, blocks, dout, q, keys, values, out, lse, dq, dkv) -> None:
    """dq [B, L, H, D] and dkv [2, B, rows, Hkv, D] += the gradients of ``blocks``."""
    for b in blocks:
        rows = b.q_rows
        dq_block, dk_block, dv_block = calls.backward(
            dout[:, rows], q[:, rows], keys[:, b.kv_rows], values[:, b.kv_rows],
            out[:, rows], lse[:, :, rows], b.causal, b.window, b.delta,
        )  # fmt: skip
        dq[:, rows] += dq_block
        dkv[0][:, b.kv_rows] += dk_block
        dkv[1][:, b.kv_rows] += dv_block


def tails_backward(dout, q, k, v, out, lse, cfg: PreparedRing, plan: Tails):
    """Gradients of :func:`tails_forward`: the K/V tails again, then the dK/dV of the
    tails received back to their owners (float32), each posted once computed."""
    ring = _exchange(cfg)
    acc = accumulation_dtype(q.dtype)
    compiling = torch.compiler.is_compiling()
    if compiling:  # the K/V tails sent again in the backward's graph, after the gradient
        k, v = traced.stack_after([k, v], dout).unbind(0)
    pending = [_send(ring, k, v, cfg, i, m) for i, m in enumerate(plan.messages)]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = torch.zeros((2,) + k.shape, dtype=acc, device=k.device)  # [2, B, L, Hkv, D]
    own_calls, tail_calls = calls_for(cfg, cfg.placement.piece_docs), calls_for(cfg, None)
    backward_blocks(own_calls, plan.own, dout, q, k, v, out, lse, dq, own)
    returned, anchors = [], []
    for message, request in zip(plan.messages, pending):
        tail = request.wait()
        _anchor(anchors, tail)
        dtail = torch.zeros(tail.shape, dtype=acc, device=tail.device)
        if compiling:  # sent back even when no block adds to it: a backward value
            dtail = traced.stack_after(list(dtail.unbind(0)), dout)
        backward_blocks(tail_calls, message.blocks, dout, q, tail[0], tail[1], out, lse, dq, dtail)
        # back to the rank it came from; ours arrive from the rank we sent to
        returned.append(start_pair(ring, dtail, cfg.kv_dims, hops=-message.hops))
        del tail, dtail
    for index, (message, request) in enumerate(zip(plan.messages, returned)):
        _add_returned(own, cfg, index, message, request.wait())
    # copies even for float32: dk and dv must not be views of one shared buffer
    # (compiled: dK's also ends every received tail's shift, traced.copy_after)
    dk = traced.copy_after(own[0], k.dtype, anchors)
    return dq.to(q.dtype), dk, own[1].to(v.dtype, copy=True)

"""A windowed dense p2p ring in the zigzag layout whose window is shorter than a chunk:
a two-way neighbour exchange of chunk tails instead of r-1 whole blocks.

Rank i holds chunks i (piece 0) and 2r-1-i (piece 1) of n = L/2 rows each. With the
kernels' left window w < n, a query chunk sees only its own keys and the last w keys of
the chunk before it (:func:`usp.ring.window.chunk_pair`):

- chunk i reads chunk i-1's tail: piece 0 of rank i-1 (nothing for i = 0);
- chunk 2r-1-i reads chunk 2r-2-i's tail: piece 1 of rank i+1 (rank r-1's own piece 0).

So every rank sends the last w rows of its piece 0 to its next rank and of its piece 1
to its previous rank; the backward sends the dK/dV of the tails it received back the
same ways. The two messages across the ring's ends (rank r-1 -> 0 forward, 0 -> r-1
backward) carry keys nobody reads: they are sent so that every rank's messages have the
same shapes (2 of the 2r). Bytes per rank: 2 K/V tails forward; 2 K/V tails and 2
dK/dV tails (float32) backward, against r-1 whole blocks (and their accumulators).

On gloo both directions are posted at once; with r = 2 the two messages between the
same pair of ranks match in the order they are posted, which is the same on both.

Compiled, each message is a functional shift of the graph (:mod:`usp.comm.traced`),
posted in the same order on every rank. Ranks 0 and r-1 never read the tail that
crosses the ring's ends, so its shift would vanish from their graphs alone and the
neighbour posting it would wait forever: every received tail ends in an opaque copy of
an output (:func:`usp.comm.traced.copy_after`, the LSE's forward, dK's backward), as in
the p2p ring. The backward's K/V tails and its first dK/dV buffers are tied to the
incoming gradient (:func:`usp.comm.traced.stack_after`), so that their shifts stay in
the backward on every rank (else rank 0's zero dK/dV of the tail it never reads, which
depends on nothing of the backward, would be sent from its forward graph alone).
"""

from __future__ import annotations

import functools
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
from usp.ring.window import dense_window_blocks


@dataclass(frozen=True)
class TailPlan:
    """One rank's blocks: against its own K/V, against the tail of its previous rank's
    piece 0 and against the tail of its next rank's piece 1 (key rows of each tail)."""

    rows: int  # w: rows of each tail
    own: tuple[Block, ...]
    prev: tuple[Block, ...]
    next: tuple[Block, ...]


def _in_tail(block: Block, tail_start: int, rows: int) -> Block | None:
    """``block`` with its key rows relative to a tail of ``rows`` rows from
    ``tail_start``, or None when its keys are not all inside it."""
    keys = block.kv_rows
    if keys.start < tail_start or keys.stop > tail_start + rows:
        return None
    shifted = slice(keys.start - tail_start, keys.stop - tail_start)
    return Block(block.q_rows, shifted, block.causal, block.window, block.delta)


def _rank_plan(ring_size: int, rank: int, local_len: int, w: int) -> TailPlan | None:
    """None when some block needs keys the tails do not hold."""
    n = local_len // 2
    prev, nxt = (rank - 1) % ring_size, (rank + 1) % ring_size
    own = tuple(dense_window_blocks("zigzag", ring_size, rank, rank, local_len, w))
    from_prev, from_next = [], []
    for kv_rank in {prev, nxt}:
        for block in dense_window_blocks("zigzag", ring_size, rank, kv_rank, local_len, w):
            first = _in_tail(block, n - w, w) if kv_rank == prev else None
            second = _in_tail(block, local_len - w, w) if kv_rank == nxt else None
            if first is None and second is None:
                return None
            (from_prev if first is not None else from_next).append(first or second)
    for kv_rank in set(range(ring_size)) - {rank, prev, nxt}:
        if dense_window_blocks("zigzag", ring_size, rank, kv_rank, local_len, w):
            return None
    return TailPlan(w, own, tuple(from_prev), tuple(from_next))


@functools.lru_cache(maxsize=64)
def zigzag_tail_plans(ring_size: int, local_len: int, w: int) -> tuple[TailPlan, ...] | None:
    """Every rank's plan, or None when one rank's blocks do not fit the tails (the
    decision is the same on every rank)."""
    plans = tuple(_rank_plan(ring_size, rank, local_len, w) for rank in range(ring_size))
    return None if any(p is None for p in plans) else plans


def tail_plan(cfg: PreparedRing, local_len: int) -> TailPlan | None:
    """This rank's :class:`TailPlan` when the call is a dense zigzag ring with a window
    shorter than a chunk, else None (the whole ring)."""
    w = cfg.window
    if w is None or cfg.packed or cfg.layout != "zigzag" or cfg.size < 2:
        return None
    if not 0 < w < local_len // 2:
        return None
    return _rank_tail_plan(cfg.size, cfg.rank, local_len, w)


@torch.compiler.assume_constant_result
def _rank_tail_plan(ring_size: int, rank: int, local_len: int, w: int) -> TailPlan | None:
    """``rank``'s plan (a constant of a compiled graph: Dynamo runs this eagerly instead
    of tracing the cached plans of every rank)."""
    plans = zigzag_tail_plans(ring_size, local_len, w)
    return None if plans is None else plans[rank]


def _exchange(cfg: PreparedRing):
    """Posted on the group (eager), or the graph's functional shifts (compiled)."""
    if torch.compiler.is_compiling():
        return TracedRingExchange(cfg.peers)
    return RingExchange(cfg.group, cfg.stats)


def _exchange_tails(ring: RingExchange, message: torch.Tensor, rows: int, dims):
    """Post [2, B, L, ...] ``message``'s piece-0 tail to the next rank and its piece-1
    tail to the previous one; returns the pending receives (previous rank's piece-0
    tail, next rank's piece-1 tail)."""
    n = message.shape[2] // 2
    first = start_pair(ring, message[:, :, n - rows : n].contiguous(), dims)
    second = start_pair(ring, message[:, :, 2 * n - rows :].contiguous(), dims, hops=-1)
    return first, second


def tails_forward(q, k, v, cfg: PreparedRing, plan: TailPlan):
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> out [B, L, H, D], lse [B, H, L] (float32)."""
    ring = _exchange(cfg)
    calls = calls_for(cfg, None)
    acc = accumulation_dtype(q.dtype)
    pending = _exchange_tails(ring, torch.stack([k, v]), plan.rows, cfg.kv_dims)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device
    )
    sources = [(plan.own, k, v)]
    anchors = []  # compiled: one element of every received tail (read or not)
    for blocks, request in zip((plan.prev, plan.next), pending):
        tail = request.wait()  # [2, B, w, Hkv, D]
        if torch.compiler.is_compiling():
            anchors.append(traced.anchor(tail))
        sources.append((blocks, tail[0], tail[1]))
    for blocks, keys, values in sources:
        for b in blocks:
            block_out, block_lse = calls.forward(
                q[:, b.q_rows], keys[:, b.kv_rows], values[:, b.kv_rows], b.causal, b.window
            )
            merge_into(out[:, b.q_rows], lse[:, :, b.q_rows], block_out, block_lse)
    if anchors:  # compiled: both shifts stay in this rank's graph
        lse = traced.copy_after(lse, lse.dtype, anchors)
    return out.to(q.dtype), lse


def tails_backward(dout, q, k, v, out, lse, cfg: PreparedRing, plan: TailPlan):
    """Gradients of :func:`tails_forward`: K/V tails again, then the dK/dV of the tails
    received back to their owners (float32)."""
    ring = _exchange(cfg)
    calls = calls_for(cfg, None)
    acc = accumulation_dtype(q.dtype)
    compiling = torch.compiler.is_compiling()
    # compiled: K/V tails exchanged again in the backward's graph, after the gradient
    message = traced.stack_after([k, v], dout) if compiling else torch.stack([k, v])
    pending = _exchange_tails(ring, message, plan.rows, cfg.kv_dims)
    del message
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = torch.zeros((2,) + k.shape, dtype=acc, device=k.device)  # [2, B, L, Hkv, D]
    grads = [own]
    sources = [(plan.own, k, v, own)]
    anchors = []  # compiled: one element of every received tail (read or not)
    for blocks, request in zip((plan.prev, plan.next), pending):
        tail = request.wait()
        zeros = torch.zeros(tail.shape, dtype=acc, device=tail.device)
        if compiling:
            anchors.append(traced.anchor(tail))
            # sent back even when no block adds to it: a backward value on every rank
            zeros = traced.stack_after(list(zeros.unbind()), dout)
        grads.append(zeros)
        sources.append((blocks, tail[0], tail[1], grads[-1]))
    for blocks, keys, values, dkv in sources:
        for b in blocks:
            rows = b.q_rows
            dq_block, dk_block, dv_block = calls.backward(
                dout[:, rows], q[:, rows], keys[:, b.kv_rows], values[:, b.kv_rows],
                out[:, rows], lse[:, :, rows], b.causal, b.window,
            )  # fmt: skip
            dq[:, rows] += dq_block
            dkv[0][:, b.kv_rows] += dk_block
            dkv[1][:, b.kv_rows] += dv_block
    # the previous rank's piece-0 tail's gradient back to it (the next rank sends ours),
    # the next rank's piece-1 tail's to it (the previous rank sends ours)
    n, w = k.shape[1] // 2, plan.rows
    first = start_pair(ring, grads[1], cfg.kv_dims, hops=-1)
    second = start_pair(ring, grads[2], cfg.kv_dims)
    own[:, :, n - w : n] += first.wait()
    own[:, :, 2 * n - w :] += second.wait()
    # compiled: dK's copy ends the K/V tails' shifts too (traced.copy_after)
    dk = traced.copy_after(own[0], k.dtype, anchors)
    return dq.to(q.dtype), dk, own[1].to(v.dtype, copy=True)

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
Eager only: a compiled graph runs the whole ring (a rank that never reads a message
would drop its shift from its graph alone).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from usp.comm.ring_exchange import RingExchange
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
    shorter than a chunk (eager), else None (the whole ring)."""
    w = cfg.window
    if w is None or cfg.packed or cfg.layout != "zigzag" or cfg.size < 2:
        return None
    if not 0 < w < local_len // 2 or torch.compiler.is_compiling():
        return None
    plans = zigzag_tail_plans(cfg.size, local_len, w)
    return None if plans is None else plans[cfg.rank]


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
    ring = RingExchange(cfg.group, cfg.stats)
    calls = calls_for(cfg, None)
    acc = accumulation_dtype(q.dtype)
    pending = _exchange_tails(ring, torch.stack([k, v]), plan.rows, cfg.kv_dims)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device
    )
    sources = [(plan.own, k, v)]
    for blocks, request in zip((plan.prev, plan.next), pending):
        tail = request.wait()  # [2, B, w, Hkv, D]
        sources.append((blocks, tail[0], tail[1]))
    for blocks, keys, values in sources:
        for b in blocks:
            block_out, block_lse = calls.forward(
                q[:, b.q_rows], keys[:, b.kv_rows], values[:, b.kv_rows], b.causal, b.window
            )
            merge_into(out[:, b.q_rows], lse[:, :, b.q_rows], block_out, block_lse)
    return out.to(q.dtype), lse


def tails_backward(dout, q, k, v, out, lse, cfg: PreparedRing, plan: TailPlan):
    """Gradients of :func:`tails_forward`: K/V tails again, then the dK/dV of the tails
    received back to their owners (float32)."""
    ring = RingExchange(cfg.group, cfg.stats)
    calls = calls_for(cfg, None)
    acc = accumulation_dtype(q.dtype)
    pending = _exchange_tails(ring, torch.stack([k, v]), plan.rows, cfg.kv_dims)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = torch.zeros((2,) + k.shape, dtype=acc, device=k.device)  # [2, B, L, Hkv, D]
    grads = [own]
    sources = [(plan.own, k, v, own)]
    for blocks, request in zip((plan.prev, plan.next), pending):
        tail = request.wait()
        grads.append(torch.zeros(tail.shape, dtype=acc, device=tail.device))
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
    return dq.to(q.dtype), own[0].to(k.dtype, copy=True), own[1].to(v.dtype, copy=True)

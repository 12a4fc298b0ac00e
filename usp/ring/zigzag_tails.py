"""A windowed dense p2p ring in the zigzag layout whose window is shorter than a chunk:
a two-way neighbour exchange of chunk tails (:mod:`usp.ring.tails`) instead of r-1
whole blocks.

Rank i holds chunks i (piece 0) and 2r-1-i (piece 1) of n = L/2 rows each. With the
kernels' left window w < n, a query chunk sees only its own keys and the last w keys of
the chunk before it (:func:`usp.ring.window.chunk_pair`):

- chunk i reads chunk i-1's tail: piece 0 of rank i-1 (nothing for i = 0);
- chunk 2r-1-i reads chunk 2r-2-i's tail: piece 1 of rank i+1 (rank r-1's own piece 0).

So every rank sends the last w rows of its piece 0 to its next rank and of its piece 1
to its previous rank; the backward sends the dK/dV of the tails it received back the
same ways. Bytes per rank: 2 K/V tails forward; 2 K/V tails and 2 dK/dV tails (float32)
backward, against r-1 whole blocks (and their accumulators).
"""

from __future__ import annotations

import functools

from usp.compile_marks import constant_result
from usp.ring.config import PreparedRing
from usp.ring.layout import Block
from usp.ring.tails import TailMessage, Tails
from usp.ring.window import dense_window_blocks


def _in_tail(block: Block, tail_start: int, rows: int) -> Block | None:
    """``block`` with its key rows relative to a tail of ``rows`` rows from
    ``tail_start``, or None when its keys are not all inside it."""
    keys = block.kv_rows
    if keys.start < tail_start or keys.stop > tail_start + rows:
        return None
    shifted = slice(keys.start - tail_start, keys.stop - tail_start)
    return Block(block.q_rows, shifted, block.causal, block.window, block.delta)


def _rank_plan(ring_size: int, rank: int, local_len: int, w: int) -> Tails | None:
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
    messages = (
        TailMessage(1, ((n - w, n),), tuple(from_prev)),  # piece 0's tail to the next rank
        TailMessage(-1, ((local_len - w, local_len),), tuple(from_next)),  # piece 1's back
    )
    return Tails(own, messages)


@functools.lru_cache(maxsize=64)
def zigzag_tail_plans(ring_size: int, local_len: int, w: int) -> tuple[Tails, ...] | None:
    """Every rank's plan, or None when one rank's blocks do not fit the tails (the
    decision is the same on every rank)."""
    plans = tuple(_rank_plan(ring_size, rank, local_len, w) for rank in range(ring_size))
    return None if any(p is None for p in plans) else plans


def tail_plan(cfg: PreparedRing, local_len: int) -> Tails | None:
    """This rank's :class:`Tails` when the call is a dense zigzag ring with a window
    shorter than a chunk (eager and compiled), else None (the whole ring)."""
    w = cfg.window
    if w is None or cfg.packed or cfg.layout != "zigzag" or cfg.size < 2:
        return None
    if not 0 < w < local_len // 2:
        return None
    return _rank_tail_plan(cfg.size, cfg.rank, local_len, w)


@constant_result
def _rank_tail_plan(ring_size: int, rank: int, local_len: int, w: int) -> Tails | None:
    """``rank``'s plan (a constant of a compiled graph: Dynamo runs this eagerly instead
    of tracing the cached plans of every rank)."""
    plans = zigzag_tail_plans(ring_size, local_len, w)
    return None if plans is None else plans[rank]

"""Packed documents on the p2p ring, a window shorter than every document's chunk: one
exchange of each document's tail with each neighbour that reads it
(:mod:`usp.ring.tails`) instead of whole blocks.

Every piece holds one chunk of every document (chunk length n_d for document d,
:mod:`usp.ring.documents`). With the kernels' left window w < min(n_d), a document's
chunk sees only its own keys and the last w keys of the chunk before it in the same
document (:func:`usp.ring.window.chunk_pair` with delta 1):

- ``contiguous`` (rank i holds chunk i): chunk i-1 is rank i-1's piece, so every rank
  sends the last w rows of each document of its piece ([2, B, N * w, Hkv, D] for N
  documents) to its next rank (rank 0 reads nothing from rank r-1);
- ``zigzag`` (rank i holds chunks i and 2r-1-i): chunk i reads rank i-1's piece 0, chunk
  2r-1-i reads rank i+1's piece 1 (rank r-1's reads its own piece 0, one of its own
  blocks), so every rank sends each document's tail of its piece 0 to its next rank and
  of its piece 1 to its previous rank, N * w rows each way.

A rank computes its own blocks as the whole ring's first step does (the diagonal varlen
calls with window w, and zigzag rank r-1's piece 1 against its piece 0 per document) and
one dense call per document against each tail it reads.
"""

from __future__ import annotations

import functools

import torch

from usp.ring.config import PreparedRing
from usp.ring.layout import Block
from usp.ring.tails import TailMessage, Tails
from usp.ring.window import chunk_pair, packed_window_blocks


def _message(bounds: tuple[int, ...], w: int, piece: int, hops: int, reads: bool) -> TailMessage:
    """The last w rows of every document of ``piece`` (sent ``hops`` ranks on) and, when
    this rank ``reads`` the message it receives, its piece's per-document calls against
    it: the same piece of the neighbour holds the chunk before each of its chunks."""
    offset = piece * bounds[-1]  # the piece's first row in the block
    ranges, blocks = [], []
    for d, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        n = stop - start
        ranges.append((offset + stop - w, offset + stop))
        pair = chunk_pair(1, n, w)
        if reads and pair is not None:
            rows, keys, causal, window = pair  # keys: the last w of the chunk at most
            first = d * w + keys.start - (n - w)  # in the received tails
            q_rows = slice(offset + start + rows.start, offset + start + rows.stop)
            kv_rows = slice(first, first + keys.stop - keys.start)
            blocks.append(Block(q_rows, kv_rows, causal, window))
    return TailMessage(hops, tuple(ranges), tuple(blocks))


@functools.lru_cache(maxsize=64)
def packed_tail_plan(
    layout: str, ring_size: int, rank: int, bounds: tuple[int, ...], w: int
) -> Tails:
    """``rank``'s :class:`Tails` for pieces with per-document ``bounds`` (each chunk
    longer than w)."""
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    own = packed_window_blocks(layout, ring_size, rank, rank, bounds[-1], lengths, w)
    messages = [_message(bounds, w, 0, 1, rank > 0)]
    if layout == "zigzag":
        messages.append(_message(bounds, w, 1, -1, rank < ring_size - 1))
    return Tails(tuple(own), tuple(messages))


def packed_tails(cfg: PreparedRing, local_len: int) -> Tails | None:
    """This rank's :class:`Tails` when the call is a packed ring whose window is shorter
    than every document's chunk (eager), else None."""
    w = cfg.window
    if w is None or not cfg.packed or cfg.size < 2 or torch.compiler.is_compiling():
        return None
    bounds = tuple(cfg.placement.documents.piece_bounds)
    if not 0 < w < min(b - a for a, b in zip(bounds, bounds[1:])):
        return None
    return packed_tail_plan(cfg.layout, cfg.size, cfg.rank, bounds, w)

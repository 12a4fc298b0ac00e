"""Which blocks of attention a ring rank computes at each step (p2p ring).

See :mod:`usp.ring.documents` for the layouts. At ring step s a rank holds the K/V
block of ring rank j = (i - s) mod r. A :class:`Block` names the local query rows and
the rows of that K/V block to attend, and whether the pair is a (square) causal diagonal
block or fully visible.
"""

from __future__ import annotations

from dataclasses import dataclass

from usp.options import layout_chunks

ALL = slice(None)


@dataclass(frozen=True)
class Block:
    q_rows: slice
    kv_rows: slice
    causal: bool
    #: the kernels' left window of the call (sliding-window layers, ``usp.ring.window``)
    window: int | None = None
    #: packed windowed blocks between different pieces: how many chunks the key piece
    #: is before the query piece (the call then runs per document); 0 otherwise
    delta: int = 0


def step_blocks(
    layout: str, causal: bool, ring_rank: int, kv_rank: int, local_len: int
) -> list[Block]:
    """Dense sequence: the blocks rank ``ring_rank`` computes against ``kv_rank``'s K/V."""
    if not causal:
        return [Block(ALL, ALL, causal=False)]
    if kv_rank == ring_rank:
        # [chunk i, chunk 2r-1-i] (or [chunk i]) is increasing in position: square causal
        return [Block(ALL, ALL, causal=True)]
    if layout == "contiguous":
        # earlier chunks are fully visible, later ones not at all
        return [Block(ALL, ALL, causal=False)] if kv_rank < ring_rank else []
    half = local_len // 2
    if kv_rank < ring_rank:
        # both my chunks (i, 2r-1-i) come after chunk j and before chunk 2r-1-j
        return [Block(ALL, slice(0, half), causal=False)]
    # j > i: my first chunk i precedes both of j's; my second chunk 2r-1-i follows both
    return [Block(slice(half, None), ALL, causal=False)]


def packed_step_blocks(
    layout: str, causal: bool, ring_rank: int, kv_rank: int, piece_len: int
) -> list[Block]:
    """Packed documents: blocks between whole *pieces* (see ``documents.py``), so every
    call pairs pieces with the same per-document boundaries; within each document the
    zigzag reasoning of :func:`step_blocks` applies chunk by chunk."""
    first, second = slice(0, piece_len), slice(piece_len, 2 * piece_len)
    if layout == "contiguous":
        if not causal:
            return [Block(ALL, ALL, causal=False)]
        if kv_rank == ring_rank:
            return [Block(ALL, ALL, causal=True)]
        return [Block(ALL, ALL, causal=False)] if kv_rank < ring_rank else []
    if not causal:
        return [Block(q, kv, causal=False) for q in (first, second) for kv in (first, second)]
    if kv_rank == ring_rank:
        # chunk i sees itself causally; chunk 2r-1-i sees chunk i fully and itself causally
        return [Block(first, first, True), Block(second, first, False), Block(second, second, True)]
    if kv_rank < ring_rank:
        return [Block(first, first, False), Block(second, first, False)]
    return [Block(second, first, False), Block(second, second, False)]


def required_local_multiple(layout: str, causal: bool) -> int:
    """The local (per ring rank) sequence length must be a multiple of this."""
    # without a causal mask key order does not matter: the sequence is one contiguous piece
    return layout_chunks(layout if causal else "contiguous", 1)


def attention_pairs(documents, causal: bool, ring_rank: int) -> int:
    """Query-key pairs ``ring_rank`` computes over the r steps of the p2p ring for a
    (packed) sequence, counted from the same block plans the ring runs: the measure of
    per-rank attention work (a causal diagonal block of n rows counts n(n+1)/2)."""
    chunk_lengths = documents.chunk_lengths
    square = int((chunk_lengths * chunk_lengths).sum())
    triangle = int((chunk_lengths * (chunk_lengths + 1) // 2).sum())
    total = 0
    for kv_rank in range(documents.ring_size):
        for block in packed_step_blocks(
            documents.layout, causal, ring_rank, kv_rank, documents.piece_len
        ):
            total += triangle if block.causal else square
    return total

"""Which blocks of attention a ring rank computes at each step, per sequence layout.

Layouts of a global sequence of S tokens over a ring of r ranks (local length L = S/r):
    contiguous: ring rank i holds chunk i of r.
    zigzag:     the sequence is cut into 2r chunks of L/2; ring rank i holds chunks
                i and 2r-1-i, so every step does the same amount of causal work.

At ring step s a rank holds the K/V block of ring rank j = (i - s) mod r. A
:class:`Block` names the local query rows and the rows of that K/V block to attend,
and whether the pair is a (square) causal diagonal block or fully visible.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Block:
    q_rows: slice
    kv_rows: slice
    causal: bool


ALL = slice(None)


def step_blocks(layout: str, causal: bool, ring_rank: int, kv_rank: int, local_len: int) -> list[Block]:
    """The blocks rank ``ring_rank`` computes against the K/V of ``kv_rank``."""
    if not causal:
        return [Block(ALL, ALL, causal=False)]
    if kv_rank == ring_rank:
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


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")


def required_local_multiple(layout: str, causal: bool) -> int:
    """The local (per ring rank) sequence length must be a multiple of this."""
    return 2 if layout == "zigzag" and causal else 1


def natural_chunk_order(layout: str, ring_size: int) -> list[tuple[int, int]]:
    """For the all-gathered K/V: natural chunk n lives at (ring rank, piece of 2 or 1).

    zigzag: chunk n < r is the first half of rank n; chunk n >= r the second half of
    rank 2r-1-n. contiguous: chunk n is rank n's only piece.
    """
    if layout == "contiguous":
        return [(n, 0) for n in range(ring_size)]
    return [(n, 0) for n in range(ring_size)] + [(2 * ring_size - 1 - n, 1) for n in range(ring_size, 2 * ring_size)]


@dataclass(frozen=True)
class Segment:
    """All-gather variant: local query rows that attend to the first ``kv_len`` keys of
    the gathered K/V in natural order (bottom-right causal when causal)."""

    q_rows: slice
    kv_len: int


def allgather_segments(layout: str, causal: bool, ring_rank: int, ring_size: int, local_len: int) -> list[Segment]:
    total = ring_size * local_len
    if not causal:
        return [Segment(ALL, total)]
    if layout == "contiguous":
        return [Segment(ALL, (ring_rank + 1) * local_len)]
    half = local_len // 2
    return [
        Segment(slice(0, half), (ring_rank + 1) * half),  # chunk i sees chunks 0..i
        Segment(slice(half, None), (2 * ring_size - ring_rank) * half),  # chunk 2r-1-i sees 0..2r-1-i
    ]

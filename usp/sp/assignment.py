"""Which documents of a packed sequence stay whole on one SP rank and which are split
over the SP group: the pure arithmetic of ``placement="documents"`` (no torch, no
process group), the same on every rank because it is computed from the agreed lengths.

A rank's estimated work is linear in its tokens plus its attention's (query, key) pairs
(:class:`DocumentCost`). A document computed whole on one rank costs that rank all of
its work; a document split over the group (the ``"sequence"`` layout of
:mod:`usp.ring.documents`: zigzag or contiguous chunks over the ring, each ring rank's
block cut into u pieces) gives every rank its share: ``n / P`` of its tokens and, after
the all-to-all, ``1 / u`` of the heads of its ring rank's chunks' pairs.

:func:`assign_documents`: the documents, costliest first, are split one by one (those
whose work alone exceeds a rank's mean share always) until the rest, placed whole by
longest-processing-time-first on the least loaded rank, leaves the busiest rank within
:data:`BALANCE_TOLERANCE` of the mean; if no number of splits reaches it, the one with
the least busy maximum. Splitting every document is the ``"sequence"`` placement, so
the search always ends. A split document must be a multiple of the plan's
``sequence_multiple`` (it is placed like a dense sequence; any set of them then splits
evenly over the Ulysses ranks), so documents of other lengths stay whole unless their
work forces a split, which is an error saying what to pad.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from usp.errors import ShardingError
from usp.options import layout_chunks

#: the busiest rank's work may exceed the mean by this fraction before another document
#: is split (splitting costs traffic; a whole document costs none)
BALANCE_TOLERANCE = 0.02


def causal_pairs(start: int, end: int, window: int | None) -> int:
    """(query, key) pairs of causal attention for the queries at positions
    ``start .. end - 1`` of one document: query ``p`` sees ``min(p + 1, window)`` keys
    (``window``: transformers' sliding window W; None: full attention)."""
    if end <= start:
        return 0
    full = end * (end + 1) // 2 - start * (start + 1) // 2  # sum of p + 1
    if window is None or end <= window:
        return full
    # queries p >= window - 1 see exactly window keys
    capped_from = max(start, window - 1)
    return (
        capped_from * (capped_from + 1) // 2 - start * (start + 1) // 2
        + (end - capped_from) * window
    )  # fmt: skip


@dataclass(frozen=True)
class DocumentCost:
    """Estimated work of a training step's documents, in FLOPs (forward + backward): per
    token ``token_flops`` (every token-local matmul of every layer, linear attention's
    recurrence), per attention (query, key) pair ``pair_flops`` of each group of layers
    sharing a sliding window (``attention``: ``((window or None, pair_flops), ...)``),
    and ``linear_ring_flops`` more per token of a document split over a ring of more
    than one rank (Gated DeltaNet's state pass adds d_k value columns to its kernel).
    :func:`usp.models.document_cost` builds it from a model's config. The default
    describes a Llama-3-8B-like model (projections and MLP of 218M parameters a layer,
    32 heads of 128): what a plan without a model balances for."""

    token_flops: float = 6 * 218e6
    attention: tuple[tuple[int | None, float], ...] = ((None, 12 * 32 * 128),)
    linear_ring_flops: float = 0.0

    def __post_init__(self):
        numbers = [self.token_flops, self.linear_ring_flops, *(f for _, f in self.attention)]
        if not all(isinstance(x, (int, float)) and x >= 0 for x in numbers):
            raise ShardingError(f"DocumentCost needs numbers >= 0, got {self}")
        for window, _ in self.attention:
            if window is not None and (not isinstance(window, int) or window < 1):
                raise ShardingError(
                    f"DocumentCost windows must be None or ints >= 1, got {window!r}"
                )

    def pairs_work(self, start: int, end: int) -> float:
        """Attention work of the queries at positions ``start .. end - 1`` of a document."""
        return sum(f * causal_pairs(start, end, w) for w, f in self.attention)

    def whole(self, n: int) -> float:
        """Work of a document of ``n`` tokens computed whole on one rank."""
        return self.token_flops * n + self.pairs_work(0, n)

    def split_shares(self, n: int, ring: int, ulysses: int, layout: str) -> list[float]:
        """Work each SP rank (``sp_rank = ring_rank * u + ulysses_rank``) does for a
        document of ``n`` tokens split over ring x ulysses ranks in ``layout``."""
        sp = ring * ulysses
        chunks = layout_chunks(layout, ring)
        size = n // chunks
        tokens = (self.token_flops + (self.linear_ring_flops if ring > 1 else 0.0)) * n / sp
        shares = []
        for ring_rank in range(ring):
            held = [ring_rank] if layout == "contiguous" else [ring_rank, 2 * ring - 1 - ring_rank]
            pairs = sum(self.pairs_work(c * size, (c + 1) * size) for c in held)
            shares += [tokens + pairs / ulysses] * ulysses
        return shares


@dataclass(frozen=True)
class DocumentAssignment:
    """Where a packed sequence's documents go (the same on every SP rank).

    ``lengths`` / ``starts``: the non-empty documents and their global offsets;
    ``split``: the indices (into ``lengths``) of the documents split over the SP group,
    in order; ``whole[rank]``: those computed whole on SP rank ``rank``
    (``ring_rank * u + ulysses_rank``), in order; ``work[rank]``: its estimated work."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    split: tuple[int, ...]
    whole: tuple[tuple[int, ...], ...]
    work: tuple[float, ...]

    @property
    def split_tokens(self) -> int:
        """Tokens of the split documents over the whole group (each rank holds 1/P)."""
        return sum(self.lengths[d] for d in self.split)

    def whole_tokens(self, rank: int) -> int:
        return sum(self.lengths[d] for d in self.whole[rank])

    def rank_tokens(self, rank: int) -> int:
        """Tokens SP rank ``rank`` holds: its share of the split documents, then its
        whole ones."""
        return self.split_tokens // len(self.whole) + self.whole_tokens(rank)

    def encoded(self) -> tuple[int, ...]:
        """The assignment as integers (what the SP ranks agree on): each document's rank,
        -1 for split."""
        owner = [-1] * len(self.lengths)
        for rank, documents in enumerate(self.whole):
            for d in documents:
                owner[d] = rank
        return tuple(owner)


def assign_documents(
    bounds: list[int] | tuple[int, ...],
    *,
    ring: int,
    ulysses: int,
    layout: str,
    multiple: int,
    cost: DocumentCost,
    tolerance: float = BALANCE_TOLERANCE,
) -> DocumentAssignment:
    """The assignment of the documents with cumulative boundaries ``bounds`` (validated:
    ``[0, ..., S]``) on ring x ulysses SP ranks; ``multiple``: what a split document's
    length must be a multiple of (the plan's ``sequence_multiple``). See the module
    docstring. Raises :class:`ShardingError` for a document that must be split but is
    not a multiple."""
    sp = ring * ulysses
    pairs = [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    starts = tuple(a for a, _ in pairs)
    lengths = tuple(n for _, n in pairs)
    whole_cost = [cost.whole(n) for n in lengths]
    mean = sum(whole_cost) / sp
    order = sorted(range(len(lengths)), key=lambda d: (-whole_cost[d], d))
    splittable = [d for d in order if lengths[d] % multiple == 0]
    for d in order:
        if whole_cost[d] > mean * (1 + tolerance) and lengths[d] % multiple:
            raise ShardingError(
                f"document {d} ({lengths[d]} tokens) holds more work than one of the {sp} SP "
                f"ranks should do, so placement='documents' splits it over the group, which "
                f"needs a multiple of {multiple} tokens; pad it (usp.pad_documents(cu_seqlens, "
                "plan) pads the documents that are split)"
            )
    # documents that alone exceed a rank's share must be split; then one more at a time
    first = sum(1 for d in splittable if whole_cost[d] > mean * (1 + tolerance))
    best = None
    for count in range(first, len(splittable) + 1):
        split, whole, work = _place(
            lengths, whole_cost, splittable[:count], order, ring, ulysses, layout, cost
        )
        if not split and not all(whole):  # a rank without tokens: split one more
            continue
        if best is None or max(work) < max(best[2]):
            best = split, whole, work
        if max(work) <= mean * (1 + tolerance):
            break
    if best is None:
        raise ShardingError(
            f"{len(lengths)} documents cannot give each of the {sp} SP ranks a token: none of "
            f"them is a multiple of {multiple} tokens, which splitting needs; pad them "
            "(usp.pad_documents(cu_seqlens, plan))"
        )
    return DocumentAssignment(lengths, starts, *best)


def _place(lengths, whole_cost, split_docs, order, ring, ulysses, layout, cost):
    """Split ``split_docs``, place the others whole (costliest first, each on the least
    loaded rank, ties to the lower rank): (split, whole per rank, work per rank)."""
    sp = ring * ulysses
    work = [0.0] * sp
    for d in split_docs:
        for rank, share in enumerate(cost.split_shares(lengths[d], ring, ulysses, layout)):
            work[rank] += share
    chosen = set(split_docs)
    heap = [(w, rank) for rank, w in enumerate(work)]
    heapq.heapify(heap)
    whole: list[list[int]] = [[] for _ in range(sp)]
    for d in order:
        if d in chosen:
            continue
        load, rank = heapq.heappop(heap)
        whole[rank].append(d)
        work[rank] = load + whole_cost[d]
        heapq.heappush(heap, (work[rank], rank))
    return (
        tuple(sorted(chosen)),
        tuple(tuple(sorted(docs)) for docs in whole),
        tuple(work),
    )


def split_padding(
    lengths: list[int], *, ring: int, ulysses: int, layout: str, multiple: int, cost: DocumentCost
) -> list[int]:
    """Document lengths grown so that every document :func:`assign_documents` splits is a
    multiple of ``multiple`` (the others keep theirs): assign as if any length could be
    split, pad the split ones, again until the split ones need nothing (padding only
    grows lengths, so at most one round per document). The assignment of the result,
    with ``multiple``, splits the same documents."""
    padded = list(lengths)
    while True:
        bounds = [0, *itertools.accumulate(padded)]
        chosen = assign_documents(
            bounds, ring=ring, ulysses=ulysses, layout=layout, multiple=1, cost=cost
        )
        nonempty = [d for d, n in enumerate(padded) if n > 0]  # assignment indices -> ours
        short = [nonempty[d] for d in chosen.split if padded[nonempty[d]] % multiple]
        if not short:
            return padded
        for d in short:
            padded[d] = -(-padded[d] // multiple) * multiple

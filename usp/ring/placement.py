"""What one ring rank's kernels need for one batch, as device tensors, built once.

A :class:`RankPlacement` holds the documents' placement (:mod:`usp.ring.documents`) for
one ring rank together with every index and boundary tensor its kernel calls use, already
on the compute device: the varlen boundaries of a piece against a piece (p2p) and, for
the all-gather ring, the rows of the gathered K/V each query piece sees. Built once per
batch (packed) or once per shape (dense, cached), so a layer's forward and backward make
no host-to-device copies and no host syncs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from usp.kernels.varlen import PackedDocs
from usp.ring.documents import Documents


@dataclass(frozen=True, eq=False)
class Segment:
    """All-gather ring: one query piece and the keys it sees."""

    q_rows: slice
    #: [n] int64 on the device: rows of the ring's gathered K/V (ring-rank order)
    kv_rows: torch.Tensor
    #: varlen boundaries (the piece's documents vs their visible keys); None when dense
    docs: PackedDocs | None


@dataclass(frozen=True, eq=False)
class RankPlacement:
    documents: Documents
    ring_rank: int
    device: torch.device
    #: packed documents (varlen kernel calls) rather than one dense sequence
    packed: bool
    #: p2p, packed: piece-vs-piece document boundaries (the same on every rank and step)
    piece_docs: PackedDocs | None
    #: all-gather: query segments, for causal=False and causal=True
    segments: dict[bool, tuple[Segment, ...]]
    #: p2p, packed: an empty tensor of shape [n, 0], n the longest document of a piece:
    #: how a compiled graph takes that bound (varlen kernels size their grid by it) as a
    #: symbolic size, so that a new packing reuses the graph; None otherwise
    longest: torch.Tensor | None = None
    #: tokens per piece (``documents.piece_len``; a field: traced code reads fields only)
    piece_len: int = field(init=False)
    #: sliding windows: the all-gather's :class:`WindowGather` per window, built once
    #: (:meth:`window_gather`) when a call is prepared (a compiled graph reads it here:
    #: Dynamo cannot trace the method); the rows of the p2p ring's tail messages
    #: (``("tails", w, message)``, :mod:`usp.ring.tails`)
    windows: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "piece_len", self.documents.piece_len)

    def window_gather(self, w: int) -> WindowGather:
        """All-gather ring, causal with the kernels' left window ``w``: what this rank
        gathers and the keys each of its query pieces sees (:class:`WindowGather`)."""
        gather = self.windows.get(w)
        if gather is None:
            gather = self.windows[w] = plan_window_gather(
                self.documents, self.ring_rank, self.packed, self.device, w
            )
        return gather


@dataclass(frozen=True, eq=False)
class WindowGather:
    """All-gather ring with a sliding window: every rank contributes only the rows of its
    block that some other rank's window reaches (the last keys of each chunk), padded to
    ``rows_per_rank`` (m, the most any rank has; the same on every rank, as an all-gather
    needs), and attends over ``[r * m gathered rows (ring-rank order), its own L rows]``.
    The padding rows repeat a row already sent: no segment reads them, so their
    gradient, reduce-scattered back like the others', is zero."""

    #: query pieces against rows of the ``[r * m + L]`` buffer above
    segments: tuple[Segment, ...]
    #: int64 [m] on the device: the rows of this rank's block it contributes
    send_rows: torch.Tensor
    rows_per_rank: int


def plan_window_gather(
    documents: Documents, ring_rank: int, packed: bool, device, w: int
) -> WindowGather:
    """``ring_rank``'s :class:`WindowGather` for the kernels' left window ``w``, from the
    keys every rank's query pieces see (``Documents.window_rows``; host work, once per
    batch and window)."""
    size, local_len, pieces = documents.ring_size, documents.local_len, documents.pieces
    # rows of the gathered sequence ([r * L], ring-rank order) each query piece sees
    seen = {
        (rank, piece): documents.window_rows(rank, piece, w)
        for rank in range(size)
        for piece in range(pieces)
    }
    needed = []  # per owner: the sorted rows of its block other ranks' windows read
    for owner in range(size):
        rows = [r for (rank, _), (r, _) in seen.items() if rank != owner]
        rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
        needed.append(torch.unique(rows[rows // local_len == owner] % local_len))
    m = max(len(rows) for rows in needed)
    # each gathered row's place in the buffer; -1 for rows no window reads
    place = torch.full((size * local_len,), -1, dtype=torch.int64)
    for owner, rows in enumerate(needed):
        place[owner * local_len + rows] = owner * m + torch.arange(len(rows))
    own = slice(ring_rank * local_len, (ring_rank + 1) * local_len)
    place[own] = size * m + torch.arange(local_len)  # its own block from the local K/V
    segments = []
    for piece in range(pieces):
        rows, bounds_k = seen[ring_rank, piece]
        docs = PackedDocs.build(documents.piece_bounds, bounds_k, device) if packed else None
        segments.append(Segment(documents.piece_rows(piece), place[rows].to(device), docs))
    send = needed[ring_rank]
    padding = send[-1:] if len(send) else torch.zeros(1, dtype=torch.int64)
    send = torch.cat([send, padding.expand(m - len(send))])
    return WindowGather(tuple(segments), send.to(device), m)


def _segments(documents: Documents, ring_rank: int, causal: bool, packed: bool, device):
    segments = []
    for piece in range(documents.pieces):
        rows, bounds_k = documents.visible_rows(ring_rank, piece, causal)
        docs = PackedDocs.build(documents.piece_bounds, bounds_k, device) if packed else None
        segments.append(Segment(documents.piece_rows(piece), rows.to(device), docs))
    return tuple(segments)


def packed_placement(
    documents: Documents, ring_rank: int, device, *, allgather: bool
) -> RankPlacement:
    """Packed documents: everything a ring rank needs on ``device`` (all-gather segments,
    for both causal flags, only if asked). One document is a dense sequence (the same
    tokens on every rank as :func:`dense_placement`'s), placed as one: its ring steps
    are the dense ones (one causal block on the diagonal, one block per other step,
    against three and two between pieces) and a ring of one runs the local kernel, with
    no varlen boundaries and no accumulators -- the long-document fine-tune's case."""
    device = torch.device(device)
    packed = len(documents.lengths) > 1
    segments = {}
    if allgather:
        segments = {c: _segments(documents, ring_rank, c, packed, device) for c in (False, True)}
    bounds = documents.piece_bounds
    piece_docs = longest = None
    if packed:
        piece_docs = PackedDocs.build(bounds, bounds, device)
        longest = torch.empty((piece_docs.max_q, 0), device=device)  # no storage
        # a compiled graph takes both as tensors of any size: one graph for every
        # packing, from the first (no recompile when the documents change)
        torch._dynamo.maybe_mark_dynamic(piece_docs.cu_q, 0)
        torch._dynamo.maybe_mark_dynamic(longest, 0)
    return RankPlacement(documents, ring_rank, device, packed, piece_docs, segments, longest)


def single_rank_placement(seq_len: int, device) -> RankPlacement:
    """A dense sequence on a ring of one: one contiguous piece, no index tensors."""
    return RankPlacement(
        Documents.single(seq_len, 1, "contiguous"), 0, torch.device(device), False, None, {}
    )


@functools.lru_cache(maxsize=64)
def dense_placement(
    seq_len: int,
    ring_size: int,
    layout: str,
    causal: bool,
    ring_rank: int,
    device: torch.device,
    allgather: bool,
) -> RankPlacement:
    """A dense sequence (cached per shape: a few small index tensors). Without a causal
    mask the order of keys does not matter, so the sequence is one contiguous piece."""
    documents = Documents.single(seq_len, ring_size, layout if causal else "contiguous")
    segments = {causal: _segments(documents, ring_rank, causal, False, device)} if allgather else {}
    return RankPlacement(documents, ring_rank, device, False, None, segments)

"""The ring part of a linear-attention layer: a rank's ring block as segments, and the
exchanges that make every segment start where the previous chunk of its document ended.

After the Ulysses all-to-all a rank holds its ring rank's whole block (see
:mod:`usp.ring.documents`): ``pieces`` pieces (2 for zigzag, 1 for contiguous), each
holding one chunk of every document. A *segment* is one (piece, document) pair: the
tokens of one chunk of one document. Its global chunk index is
``documents.chunk_of(ring_rank, piece)``; chunk c of every document lives on ring rank
``owner(c)`` in piece ``piece(c)``.

Two things pass between the chunks of a document, both by one all-gather over the ring
(so every rank sees every chunk's summary at once and no rank waits for another's
compute):

- the conv's context: each segment's last ``kernel - 1`` inputs (:func:`conv_contexts`
  builds each segment's left context from the earlier chunks' tails);
- the state: each segment computed from a zero state gives its affine map
  ``S_end = M S_start + B`` (M [d_k, d_k], B [d_k, d_v]); :func:`start_states` composes
  them in chunk order into each segment's start state (a prefix scan, on every rank).

The backward of an all-gather is a reduce-scatter (:class:`RingAllGather`), so
gradients flow back to the chunks the tails and states came from, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_into, reduce_scatter_into
from usp.comm.stats import CommStats
from usp.planning_mode import representative
from usp.ring.documents import Documents


@dataclass(frozen=True)
class Segments:
    """Rank ``ring_rank``'s block as segments, in block order (piece-major)."""

    documents: Documents
    ring_rank: int

    @property
    def num_docs(self) -> int:
        return len(self.documents.lengths)

    @property
    def count(self) -> int:
        return self.documents.pieces * self.num_docs

    @property
    def bounds(self) -> list[int]:
        """Cumulative boundaries of the segments inside the block ([0, ..., local_len])."""
        docs = self.documents
        out = [0]
        for piece in range(docs.pieces):
            base = piece * docs.piece_len
            out.extend(base + b for b in docs.piece_bounds[1:])
        return out

    def chunk_length(self, doc: int) -> int:
        return self.documents.lengths[doc] // self.documents.chunks_per_doc

    def chunk(self, segment: int) -> int:
        """The global chunk index (inside its document) of local segment ``segment``."""
        return self.documents.chunk_of(self.ring_rank, segment // self.num_docs)

    def doc(self, segment: int) -> int:
        return segment % self.num_docs

    @property
    def composed_chunks(self) -> int:
        """How many chunks the prefix scan composes (:func:`compose_in_chunk_order`):
        up to the latest chunk a local segment starts at, at most a document's chunks."""
        latest = max(self.chunk(s) for s in range(self.count))
        return min(latest, self.documents.chunks_per_doc)

    def source(self, chunk: int, doc: int) -> tuple[int, int]:
        """(ring rank, its local segment index) holding chunk ``chunk`` of ``doc``."""
        r = self.documents.ring_size
        if chunk < r:
            return chunk, doc
        return 2 * r - 1 - chunk, self.num_docs + doc


class RingAllGather(torch.autograd.Function):
    """[..] on every ring rank -> [r, ..] (ring-rank order); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, stats: CommStats | None):
        ctx.group, ctx.stats = group, stats
        size = dist.get_world_size(group)
        out = x.new_empty(size, *x.shape)
        all_gather_into(out.view(size * x.shape[0], *x.shape[1:]), x.contiguous(), group, stats)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = grad.shape[0]
        out = grad.new_empty(grad.shape[1:])
        full = grad.contiguous().view(size * grad.shape[1], *grad.shape[2:])
        reduce_scatter_into(out, full, ctx.group, ctx.stats)
        return out, None, None


def ring_all_gather(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    return RingAllGather.apply(x, group, stats)


def segment_tails(x_padded: torch.Tensor, segments: Segments, batch: int, width: int):
    """The last ``width`` inputs of every segment ([B * N, L, C] -> [B, N, width, C]),
    left-padded with zeros when a segment is shorter."""
    rows = []
    length = x_padded.shape[1]
    for segment in range(segments.count):
        n = segments.chunk_length(segments.doc(segment))
        idx = torch.arange(n - width, n)
        rows.append(torch.where(idx >= 0, idx, length))  # `length`: a zero row
    index = torch.stack(rows).to(x_padded.device)  # [N, width]
    x = x_padded.reshape(batch, segments.count, length, -1)
    x = torch.cat([x, x.new_zeros(batch, segments.count, 1, x.shape[-1])], dim=2)
    return torch.stack([x[:, s, index[s]] for s in range(segments.count)], dim=1)


def conv_contexts(tails: torch.Tensor, segments: Segments, width: int) -> torch.Tensor:
    """Each local segment's left context: the last ``width`` inputs of its document
    before it (zeros before the document's start). ``tails`` [r, B, N, width, C] (every
    ring rank's :func:`segment_tails`) -> [B, N, width, C]."""
    # zeros that depend on ``tails``: every rank's gathered tensor is in its graph, so every
    # rank enters the backward's reduce-scatter (a rank of first chunks reads no tail)
    zeros = tails[0, :, 0] * 0
    out = []
    for segment in range(segments.count):
        doc, chunk = segments.doc(segment), segments.chunk(segment)
        real = min(width, segments.chunk_length(doc))
        parts = [zeros]
        for c in range(max(0, chunk - -(-width // real)), chunk):  # the chunks it reaches
            rank, index = segments.source(c, doc)
            parts.append(tails[rank, :, index, width - real :])
        out.append(torch.cat(parts, dim=1)[:, -width:])
    return torch.stack(out, dim=1)


def start_states(pairs: torch.Tensor, segments: Segments, dv: int) -> torch.Tensor:
    """Each local segment's start state from every segment's affine map (the delta rule).

    ``pairs`` [r, B, N, H, dk, dv + dk]: segment maps computed from the state [0 | I]
    (columns :dv are B, the rest M: S_end = M S_start + B). Returns [B, N, H, dk, dv]."""
    zero = pairs[0, :, : segments.num_docs, ..., :dv] * 0  # in the graph on every rank
    return compose_in_chunk_order(
        pairs, segments, zero, lambda pair, state: pair[..., dv:] @ state + pair[..., :dv]
    )


def scalar_start_states(maps: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each local segment's start state from every segment's map under a scalar decay
    per head (Mamba-2): ``maps`` [r, B, N, H, X + 1], the state a segment reaches from
    zero (X numbers: dk * dv, flattened) and its decay product exp(sum g):
    S_end = decay S_start + B. Returns [B, N, H, X]. Planned under ``usp plan``'s fake
    tensors (:class:`_PlannedScalarComposition`)."""
    if representative(maps):  # usp plan, fake tensors: the loop's memory without its ops
        return _PlannedScalarComposition.apply(maps, segments.composed_chunks, segments.num_docs)
    zero = maps[0, :, : segments.num_docs, :, :-1] * 0
    return compose_in_chunk_order(
        maps, segments, zero, lambda m, state: m[..., -1:] * state + m[..., :-1]
    )


def compose_in_chunk_order(maps: torch.Tensor, segments: Segments, zero, step) -> torch.Tensor:
    """The prefix scan of segment maps in chunk order, on every rank: ``maps`` [r, B, N, ..]
    (every ring rank's segments), ``zero`` [B, docs, ..] a document's start state (a
    tensor computed from ``maps``, so that every rank's gathered maps are in its graph and
    every rank enters the backward's reduce-scatter, see :func:`conv_contexts`), ``step``
    (map [B, docs, ..], state) -> the state after that chunk. Returns each local
    segment's start state [B, N, ..]."""
    docs = segments.num_docs
    state = zero
    before = [state]  # before[c]: every document's state at the start of chunk c
    for c in range(segments.composed_chunks):
        sources = [segments.source(c, d) for d in range(docs)]
        chunk_maps = torch.stack([maps[rank, :, index] for rank, index in sources], dim=1)
        state = step(chunk_maps, state)
        before.append(state)
    return torch.stack(
        [before[segments.chunk(s)][:, segments.doc(s)] for s in range(segments.count)], dim=1
    )


class _PlannedScalarComposition(torch.autograd.Function):
    """:func:`scalar_start_states`'s loop over chunks as ``usp plan`` measures it (fake
    tensors inside :func:`usp.planning_mode.representative_tiles`): a few allocations
    that hold at every moment at least what the loop holds (2r - 1 chunks at most: with
    the ring's all-gather and the conv's context, the ops a Mamba-2 layer runs per chunk
    of the ring, not per token).

    With K steps (chunks composed), D documents, N local segments, per batch row and head:
    Z = D X (every document's state), M = D (X + 1) (a chunk's maps, stacked), R the
    gathered maps (r N (X + 1)). The real forward makes the zero state (Z), then per step
    the stacked maps (M, kept: the product's saved view reads them), a product (Z,
    freed) and the next state (Z, kept: the next product saves it); then the segments'
    start states are stacked (N X). So it holds at most Z + K(M + Z) + max(Z, N X) and
    keeps Z + K(M + Z). Here: the same.

    The real backward: each segment's select gives a zero-filled state gradient (Z,
    held until its chunk is reached: at most N + 1 with the running one and one
    transient); a step's product and slice backwards make two Z and three M (two
    zero-filled slices and their sum); every select of the gathered maps makes a
    zero-filled R, added into the maps' gradient (R; out of place: three R at once).
    Here, with the saved tensors held to the end: (N + 2) Z, 3M + 2Z of temporaries
    and 3R, then the maps' gradient (R).
    ``tests/planner/test_planner_granite.py`` measures both under the tracker.
    """

    @staticmethod
    def forward(ctx, maps, steps: int, docs: int):
        r, batch, count, heads, width = maps.shape  # width: X + 1
        x = width - 1
        kept = maps.new_empty(batch, heads, docs * (x + steps * (width + x)))
        temporary = maps.new_empty(batch, docs, heads, x)
        del temporary
        out = maps.new_empty(batch, count, heads, x)
        ctx.save_for_backward(kept)
        ctx.shape = (r, batch, count, heads, width, docs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (kept,) = ctx.saved_tensors
        r, batch, count, heads, width, docs = ctx.shape
        x = width - 1
        state_grads = kept.new_empty(batch, heads, (count + 2) * docs * x)
        temporaries = kept.new_empty(batch, heads, docs * (3 * width + 2 * x))
        maps_grads = kept.new_empty(3, r, batch, count, heads, width)
        del temporaries, maps_grads, state_grads
        return kept.new_empty(r, batch, count, heads, width), None, None

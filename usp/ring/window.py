"""Sliding windows on the ring: which part of a block a window keeps, and how many ring
steps a windowed layer needs.

``w`` is the kernels' left window (spec.py): the query at position p of its document
sees keys p - w .. p (transformers' ``sliding_window`` W is w = W - 1). Every document
is cut into chunks of n tokens (:mod:`usp.ring.documents`); a ring block pairs a query
chunk with a key chunk ``delta`` chunks before it. Within one document:

- ``delta < 0``: the keys come after every query: nothing.
- ``delta == 0``: the diagonal chunk: one causal call with window w (None when the
  window covers the chunk).
- ``delta > 0``: keys K0 .. K0+n-1 with K0 = Q0 - delta*n. The first query sees keys
  from Q0 - w, so the keys before ``a = max(0, delta*n - w)`` (chunk-relative) are
  outside every query's window, and only the first ``min(n, w - (delta-1)*n)`` queries
  see any key of the chunk (the later ones' windows start after it). Those rows see a
  *lower* bound only (every key is before them): a non-causal call whose left window
  ``n - rows - delta*n + w`` aligns the kernel's bottom-right diagonal with the true one
  (or no window when every row sees every kept key); the block is skipped when no key
  is inside any window (``a >= n``).

A dense sequence is one document, so its blocks are cut to these rows and keys. Packed
documents have one chunk length each, so a windowed block between two different pieces
runs one dense call per document (:class:`WindowDocuments`, built once per batch and
kept with the batch's boundaries); a diagonal block is one varlen call with window w.

The p2p ring rotates only while some rank still has a block inside the window
(:func:`ring_steps`): a window shorter than a chunk needs the previous chunk only, so a
contiguous ring stops after one exchange.
"""

from __future__ import annotations

import functools

import torch

from usp.kernels.masks import accumulation_dtype
from usp.ring.layout import Block


def chunk_pair(delta: int, n: int, w: int) -> tuple[slice, slice, bool, int | None] | None:
    """(query rows, key rows, causal, window) of a query chunk against the key chunk
    ``delta`` chunks before it (both of n tokens), or None when no pair is visible."""
    if delta < 0 or n == 0:
        return None
    if delta == 0:
        return slice(0, n), slice(0, n), True, (w if w < n - 1 else None)
    first_key = max(0, delta * n - w)
    if first_key >= n:
        return None
    rows = min(n, w - (delta - 1) * n)
    every_key = delta * n + rows - 1 - w <= first_key  # the last row still sees the first key
    window = None if every_key else n - rows - delta * n + w
    return slice(0, rows), slice(first_key, n), False, window


def _shift(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def _chunk_of(layout: str, ring_size: int, ring_rank: int, piece: int) -> int:
    return ring_rank if piece == 0 else 2 * ring_size - 1 - ring_rank


def _pieces(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def dense_window_blocks(
    layout: str, ring_size: int, ring_rank: int, kv_rank: int, local_len: int, w: int
) -> list[Block]:
    """A dense (causal) sequence: the blocks of ``ring_rank``'s queries against
    ``kv_rank``'s keys that the window keeps, cut to the rows and keys it needs."""
    pieces = _pieces(layout)
    n = local_len // pieces
    blocks = []
    for q_piece in range(pieces):
        q_chunk = _chunk_of(layout, ring_size, ring_rank, q_piece)
        for kv_piece in range(pieces):
            kv_chunk = _chunk_of(layout, ring_size, kv_rank, kv_piece)
            pair = chunk_pair(q_chunk - kv_chunk, n, w)
            if pair is None:
                continue
            rows, keys, causal, window = pair
            blocks.append(
                Block(_shift(rows, q_piece * n), _shift(keys, kv_piece * n), causal, window)
            )
    return blocks


def packed_window_blocks(
    layout: str, ring_size: int, ring_rank: int, kv_rank: int, piece_len: int,
    chunk_lengths: tuple[int, ...] | None, w: int,
) -> list[Block]:  # fmt: skip
    """Packed documents: blocks between whole pieces; a diagonal one is a varlen call
    with window w, one between different pieces (``delta`` > 0) is kept when the window
    reaches it in some document and runs per document (:class:`WindowDocuments`).
    ``chunk_lengths`` None (a compiled graph, any packing): every block with delta > 0."""
    blocks = []
    for q_piece in range(_pieces(layout)):
        q_chunk = _chunk_of(layout, ring_size, ring_rank, q_piece)
        q_rows = slice(q_piece * piece_len, (q_piece + 1) * piece_len)
        for kv_piece in range(_pieces(layout)):
            delta = q_chunk - _chunk_of(layout, ring_size, kv_rank, kv_piece)
            kv_rows = slice(kv_piece * piece_len, (kv_piece + 1) * piece_len)
            if delta == 0:
                blocks.append(Block(q_rows, kv_rows, True, w))
            elif delta > 0 and (
                chunk_lengths is None or any(chunk_pair(delta, n, w) for n in chunk_lengths)
            ):
                blocks.append(Block(q_rows, kv_rows, False, w, delta))
    return blocks


@functools.lru_cache(maxsize=256)
def ring_steps(
    layout: str, ring_size: int, local_len: int, chunk_lengths: tuple[int, ...] | None, w: int
) -> int:
    """How many p2p ring steps a windowed call needs: one more than the last step at
    which any rank has a block inside the window (the same number on every rank).
    ``chunk_lengths``: the packed documents' chunk lengths, None for a dense sequence."""
    last = 0
    for rank in range(ring_size):
        for step in range(ring_size):
            kv_rank = (rank - step) % ring_size
            if chunk_lengths is None:
                found = dense_window_blocks(layout, ring_size, rank, kv_rank, local_len, w)
            else:
                piece_len = local_len // _pieces(layout)
                found = packed_window_blocks(
                    layout, ring_size, rank, kv_rank, piece_len, chunk_lengths, w
                )
            if found:
                last = max(last, step)
    return last + 1


class WindowDocuments:
    """A windowed block between two different pieces of packed documents, as one dense
    call per document (each document's chunk length gives it its own rows, keys and
    window, :func:`chunk_pair`), on [1, piece, h, D] tensors. Rows a window does not
    reach get out = 0 and lse = -inf (merging them changes nothing) and dq = 0."""

    def __init__(self, kernels, docs, delta: int, w: int):
        self.calls = []  # (query rows, key rows, prepared dense call)
        starts = docs.bounds_q[:-1]
        for start, stop in zip(starts, docs.bounds_q[1:]):
            pair = chunk_pair(delta, stop - start, w)
            if pair is None:
                continue
            rows, keys, causal, window = pair
            self.calls.append((_shift(rows, start), _shift(keys, start), causal, window))
        self.kernels = kernels

    def shapes(self, heads: int, kv_heads: int) -> set[tuple]:
        """(Sq, Sk, H, Hkv, causal, varlen, window) of every call (to resolve up front)."""
        return {
            (r.stop - r.start, k.stop - k.start, heads, kv_heads, c, False, w)
            for r, k, c, w in self.calls
        }

    def _call(self, q_rows, k_rows, causal, window, q, k):
        rows, keys = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
        return self.kernels.dense(rows, keys, q.shape[2], k.shape[2], causal, window)

    def forward(self, q, k, v):
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        lse = torch.full(
            (1, q.shape[2], q.shape[1]), float("-inf"), dtype=accumulation_dtype(q.dtype),
            device=q.device,
        )  # fmt: skip
        for rows, keys, causal, window in self.calls:
            doc_out, doc_lse = self._call(rows, keys, causal, window, q, k).forward(
                q[:, rows], k[:, keys], v[:, keys]
            )
            out[:, rows] = doc_out
            lse[:, :, rows] = doc_lse
        return out, lse

    def backward(self, dout, q, k, v, out, lse):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys, causal, window in self.calls:
            doc_dq, doc_dk, doc_dv = self._call(rows, keys, causal, window, q, k).backward(
                dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows]
            )
            dq[:, rows] = doc_dq
            dk[:, keys] += doc_dk
            dv[:, keys] += doc_dv
        return dq, dk, dv


def window_documents(kernels, docs, delta: int, w: int) -> WindowDocuments:
    """The :class:`WindowDocuments` of a block, built once per batch and block kind
    (kept with the batch's boundaries, as :func:`usp.kernels.dispatch.document_calls`)."""
    key = ("window", id(kernels), delta, w)
    calls = docs.per_document.get(key)
    if calls is None or calls.kernels is not kernels:
        calls = docs.per_document[key] = WindowDocuments(kernels, docs, delta, w)
    return calls

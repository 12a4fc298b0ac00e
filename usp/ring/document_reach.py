"""Packed documents on the p2p ring whose window reaches past some document's chunk (a
short document in a pack): each rank receives, straight from their owners, exactly the
rows of earlier chunks its windows read, per document, instead of rotating whole blocks.

Every piece holds one chunk of every document (chunk length n_d, :mod:`usp.ring.documents`).
With the kernels' left window w, chunk c of document d reads from chunk c-j (j >= 1) its
last t_dj = min(n_d, w - (j-1) n_d) rows when that is > 0 (:func:`usp.ring.window.chunk_pair`
with delta j): a document whose chunk is shorter than w reaches several chunks back,
a longer one only the chunk before. For each query chunk c and distance j whose source
chunk lives on another rank, the owner sends one message of those rows of every document
that reaches it; the receiver computes one dense call per document against it, and in
the backward sends that message's float32 dK/dV straight back. Chunks of one rank
against each other are its own blocks (:func:`usp.ring.window.packed_window_blocks`).

Messages between two ranks are posted in the order of (query chunk, distance) on both.
Unlike :mod:`usp.ring.tails` the amounts differ between ranks (rank 0's first chunk is
read by every later one; under ``zigzag`` rank i holds chunks i and 2r-1-i), so
``traffic_formula(..., rank=)`` states them per rank. Eager only (a compiled graph runs
the whole ring with masked blocks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from usp.comm.ring_exchange import RingExchange
from usp.kernels.masks import accumulation_dtype
from usp.ring.calls import calls_for
from usp.ring.config import PreparedRing
from usp.ring.layout import Block
from usp.ring.tails import backward_blocks, forward_blocks
from usp.ring.window import chunk_pair, packed_window_blocks


@dataclass(frozen=True)
class Send:
    """Rows of this rank's block (one range per document that reaches them) to ``peer``."""

    peer: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Receive:
    """``rows`` rows from ``peer``, and this rank's per-document blocks against them."""

    peer: int
    rows: int
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class DocumentReach:
    own: tuple[Block, ...]
    sends: tuple[Send, ...]
    receives: tuple[Receive, ...]


def chunk_owner(layout: str, ring_size: int, chunk: int) -> tuple[int, int]:
    """(ring rank, piece) holding ``chunk`` of every document."""
    if layout == "contiguous" or chunk < ring_size:
        return chunk, 0
    return 2 * ring_size - 1 - chunk, 1


@functools.lru_cache(maxsize=64)
def document_reach(
    layout: str, ring_size: int, rank: int, bounds: tuple[int, ...], w: int
) -> DocumentReach:
    """``rank``'s messages for pieces with per-document ``bounds`` and left window w."""
    piece_len = bounds[-1]
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    own = packed_window_blocks(layout, ring_size, rank, rank, piece_len, lengths, w)
    chunks = 2 * ring_size if layout == "zigzag" else ring_size
    # the farthest chunk back any document's window reaches (chunk_pair: j*n - w < n)
    farthest = max((w + n - 1) // n for n in lengths)
    sends, receives = [], []
    for chunk in range(chunks):  # the query chunk, then how far back its keys are
        q_rank, q_piece = chunk_owner(layout, ring_size, chunk)
        for j in range(1, min(chunk, farthest) + 1):
            k_rank, k_piece = chunk_owner(layout, ring_size, chunk - j)
            if q_rank == k_rank or rank not in (q_rank, k_rank):
                continue
            ranges, blocks, rows = [], [], 0
            for start, n in zip(bounds, lengths):
                pair = chunk_pair(j, n, w)
                if pair is None:
                    continue
                q_rows, keys, causal, window = pair
                first = k_piece * piece_len + start
                ranges.append((first + keys.start, first + keys.stop))
                first = q_piece * piece_len + start
                size = keys.stop - keys.start
                q_rows = slice(first + q_rows.start, first + q_rows.stop)
                blocks.append(Block(q_rows, slice(rows, rows + size), causal, window))
                rows += size
            if not ranges:
                continue
            if rank == k_rank:
                sends.append(Send(q_rank, tuple(ranges)))
            else:
                receives.append(Receive(k_rank, rows, tuple(blocks)))
    return DocumentReach(tuple(own), tuple(sends), tuple(receives))


def reach_plan(cfg: PreparedRing, local_len: int) -> DocumentReach | None:
    """This rank's :class:`DocumentReach` for a packed windowed ring (eager), else None."""
    w = cfg.window
    if w is None or not cfg.packed or cfg.size < 2 or torch.compiler.is_compiling():
        return None
    bounds = tuple(cfg.placement.documents.piece_bounds)
    return document_reach(cfg.layout, cfg.size, cfg.rank, bounds, w)


def _rows(cfg: PreparedRing, index: int, send: Send, device) -> torch.Tensor:
    """int64 [rows] on the device of a send, made once per batch (with the placement)."""
    key = ("reach", cfg.window, index)
    rows = cfg.placement.windows.get(key)
    if rows is None:
        parts = [torch.arange(start, stop) for start, stop in send.ranges]
        rows = cfg.placement.windows[key] = torch.cat(parts).to(device)
    return rows


def _wire(cfg: PreparedRing, pair: torch.Tensor) -> torch.Tensor:
    """A [2, B, rows, Hkv, D] pair as sent: K's and V's real columns only (MLA)."""
    dims = cfg.kv_dims
    return pair if dims is None or dims.key_dim == dims.value_dim else dims.pack(pair)


def _buffer(cfg: PreparedRing, shape, dtype, device) -> torch.Tensor:
    """An empty receive buffer for a pair of ``shape``, as :func:`_wire` sends it."""
    dims = cfg.kv_dims
    if dims is None or dims.key_dim == dims.value_dim:
        return torch.empty(shape, dtype=dtype, device=device)
    per_row = shape[1] * shape[3] * (dims.key_dim + dims.value_dim)
    return torch.empty(per_row * shape[2], dtype=dtype, device=device)


def _unwire(cfg: PreparedRing, received: torch.Tensor, shape) -> torch.Tensor:
    dims = cfg.kv_dims
    if dims is None or dims.key_dim == dims.value_dim:
        return received
    return dims.unpack(received, shape)


def _exchange_kv(ring, k, v, cfg: PreparedRing, plan: DocumentReach):
    """Post every K/V message; returns the receive handles and the sends' handle."""
    sends = []
    for index, send in enumerate(plan.sends):
        rows = _rows(cfg, index, send, k.device)
        pair = torch.stack([k.index_select(1, rows), v.index_select(1, rows)])
        sends.append((_wire(cfg, pair), send.peer))
    shapes = [(2, k.shape[0], r.rows, *k.shape[2:]) for r in plan.receives]
    receives = [
        (_buffer(cfg, shape, k.dtype, k.device), r.peer) for shape, r in zip(shapes, plan.receives)
    ]
    handles, sent = ring.post(sends, receives)
    return handles, shapes, sent


def reach_forward(q, k, v, cfg: PreparedRing, plan: DocumentReach):
    """q [1, L, H, D], k/v [1, L, Hkv, D] -> out [1, L, H, D], lse [1, H, L] (float32)."""
    ring = RingExchange(cfg.group, cfg.stats)
    acc = accumulation_dtype(q.dtype)
    handles, shapes, sent = _exchange_kv(ring, k, v, cfg, plan)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device
    )
    # its own blocks while the messages travel, then each message's as it arrives
    forward_blocks(calls_for(cfg, cfg.placement.piece_docs), plan.own, q, k, v, out, lse)
    dense = calls_for(cfg, None)
    for receive, handle, shape in zip(plan.receives, handles, shapes):
        tail = _unwire(cfg, handle.wait(), shape)  # [2, 1, rows, Hkv, D]
        forward_blocks(dense, receive.blocks, q, tail[0], tail[1], out, lse)
    sent.wait()
    return out.to(q.dtype), lse


def reach_backward(dout, q, k, v, out, lse, cfg: PreparedRing, plan: DocumentReach):
    """Gradients of :func:`reach_forward`: the K/V messages again, then every received
    message's dK/dV (float32) straight back to its owner, added at the rows it sent."""
    ring = RingExchange(cfg.group, cfg.stats)
    acc = accumulation_dtype(q.dtype)
    handles, shapes, sent = _exchange_kv(ring, k, v, cfg, plan)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = torch.zeros((2,) + k.shape, dtype=acc, device=k.device)  # [2, 1, L, Hkv, D]
    backward_blocks(
        calls_for(cfg, cfg.placement.piece_docs), plan.own, dout, q, k, v, out, lse, dq, own
    )  # while the messages travel
    dense, back = calls_for(cfg, None), []  # back: (dK/dV of a received message, its owner)
    for receive, handle, shape in zip(plan.receives, handles, shapes):
        tail = _unwire(cfg, handle.wait(), shape)
        dtail = torch.zeros(shape, dtype=acc, device=k.device)
        backward_blocks(dense, receive.blocks, dout, q, tail[0], tail[1], out, lse, dq, dtail)
        back.append((_wire(cfg, dtail), receive.peer))
        del tail, dtail
    sent.wait()
    # every received message's gradient back to its owner; ours from our sends' readers
    sizes = [(2, k.shape[0], sum(b - a for a, b in s.ranges), *k.shape[2:]) for s in plan.sends]
    receives = [(_buffer(cfg, shape, acc, k.device), s.peer) for shape, s in zip(sizes, plan.sends)]
    returned, sent = ring.post(back, receives)
    for index, (send, handle, shape) in enumerate(zip(plan.sends, returned, sizes)):
        own.index_add_(2, _rows(cfg, index, send, k.device), _unwire(cfg, handle.wait(), shape))
    sent.wait()
    # copies even for float32: dk and dv must not be views of one shared buffer
    return dq.to(q.dtype), own[0].to(k.dtype, copy=True), own[1].to(v.dtype, copy=True)

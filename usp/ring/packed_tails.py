"""Packed documents, contiguous p2p ring, a window shorter than every document's chunk:
one exchange of each document's tail instead of a whole block.

Ring rank i's piece holds chunk i of every document (chunk length n_d for document d).
With the kernels' left window w < min(n_d), chunk i of a document sees only its own keys
and the last w keys of chunk i-1 of the same document (:func:`usp.ring.window.chunk_pair`
with delta 1), which rank i-1 holds. So each rank sends the last w rows of every
document of its piece ([2, B, N * w, Hkv, D] for N documents) to its next rank, computes
its diagonal block (one varlen call with window w) and one dense call per document
against the tail it received; the backward sends the tails again and returns their
dK/dV (float32) the other way. Rank 0 reads nothing from rank r-1 (the message across
the ring's end is sent so that every rank sends the same). Eager only (a windowed
packed call does not compile).
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
from usp.ring.window import chunk_pair


@dataclass(frozen=True)
class PackedTails:
    """The rows of this rank's piece it sends (every document's last w) and, when it
    reads its previous rank's tails, the per-document calls against them: (query rows,
    key rows of the received tails, causal, window)."""

    rows: tuple[int, ...]
    calls: tuple[tuple[slice, slice, bool, int | None], ...]


@functools.lru_cache(maxsize=64)
def _tails(bounds: tuple[int, ...], w: int, reads: bool) -> PackedTails:
    rows, calls = [], []
    for d, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        n = stop - start
        rows.extend(range(stop - w, stop))
        pair = chunk_pair(1, n, w)
        if reads and pair is not None:
            q_rows, keys, causal, window = pair  # keys: the last w of the chunk at most
            first = d * w + keys.start - (n - w)  # in the received tails
            calls.append(
                (slice(start + q_rows.start, start + q_rows.stop),
                 slice(first, first + keys.stop - keys.start), causal, window)
            )  # fmt: skip
    return PackedTails(tuple(rows), tuple(calls))


def packed_tails(cfg: PreparedRing, local_len: int) -> PackedTails | None:
    """This rank's :class:`PackedTails` when the call is a packed contiguous ring whose
    window is shorter than every document's chunk (eager), else None."""
    w = cfg.window
    if w is None or not cfg.packed or cfg.layout != "contiguous" or cfg.size < 2:
        return None
    if torch.compiler.is_compiling():
        return None
    bounds = tuple(cfg.placement.documents.piece_bounds)
    if not 0 < w < min(b - a for a, b in zip(bounds, bounds[1:])):
        return None
    return _tails(bounds, w, cfg.rank > 0)


def _send_tails(ring, k, v, plan: PackedTails, cfg: PreparedRing):
    # the rows as a device tensor, made once per batch (kept with the placement)
    key = ("packed_tails", cfg.window)
    rows = cfg.placement.windows.get(key)
    if rows is None:
        rows = cfg.placement.windows[key] = torch.tensor(plan.rows, device=k.device)
    tails = torch.stack([k, v]).index_select(2, rows)  # [2, B, N * w, Hkv, D]
    return rows, start_pair(ring, tails, cfg.kv_dims)


def _dense(cfg: PreparedRing, q, k, rows: slice, keys: slice, causal, window):
    sq, sk = rows.stop - rows.start, keys.stop - keys.start
    return cfg.kernels.dense(sq, sk, q.shape[2], k.shape[2], causal, window)


def packed_tails_forward(q, k, v, cfg: PreparedRing, plan: PackedTails):
    """q [1, L, H, D], k/v [1, L, Hkv, D] -> out [1, L, H, D], lse [1, H, L] (float32)."""
    ring = RingExchange(cfg.group, cfg.stats)
    acc = accumulation_dtype(q.dtype)
    _, pending = _send_tails(ring, k, v, plan, cfg)
    out, lse = calls_for(cfg, cfg.placement.piece_docs).forward(q, k, v, True, cfg.window)
    out, lse = out.to(acc), lse.to(acc)
    tails = pending.wait()
    for rows, keys, causal, window in plan.calls:
        block_out, block_lse = _dense(cfg, q, tails[0], rows, keys, causal, window).forward(
            q[:, rows], tails[0][:, keys], tails[1][:, keys]
        )
        merge_into(out[:, rows], lse[:, :, rows], block_out, block_lse)
    return out.to(q.dtype), lse


def packed_tails_backward(dout, q, k, v, out, lse, cfg: PreparedRing, plan: PackedTails):
    """Gradients of :func:`packed_tails_forward`."""
    ring = RingExchange(cfg.group, cfg.stats)
    acc = accumulation_dtype(q.dtype)
    rows_sent, pending = _send_tails(ring, k, v, plan, cfg)
    dq, dk, dv = calls_for(cfg, cfg.placement.piece_docs).backward(
        dout, q, k, v, out, lse, True, cfg.window
    )
    dq, own = dq.to(acc), torch.stack([dk, dv]).to(acc)  # own: [2, 1, L, Hkv, D]
    tails = pending.wait()
    dtails = torch.zeros(tails.shape, dtype=acc, device=tails.device)
    for rows, keys, causal, window in plan.calls:
        dq_rows, dk_keys, dv_keys = _dense(cfg, q, tails[0], rows, keys, causal, window).backward(
            dout[:, rows], q[:, rows], tails[0][:, keys], tails[1][:, keys], out[:, rows],
            lse[:, :, rows],
        )  # fmt: skip
        dq[:, rows] += dq_rows
        dtails[0][:, keys] += dk_keys
        dtails[1][:, keys] += dv_keys
    # the previous rank's tails' gradients back to it; ours arrive from the next rank
    returned = start_pair(ring, dtails, cfg.kv_dims, hops=-1).wait()
    own.index_add_(2, rows_sent, returned)
    # copies even for float32: dk and dv must not be views of one shared buffer
    return dq.to(q.dtype), own[0].to(k.dtype, copy=True), own[1].to(v.dtype, copy=True)

"""Ring attention by all-gathering K/V (optionally a few KV heads at a time).

Every rank gathers the K/V blocks of its ring group (in ring-rank order), selects for
each of its query pieces the keys that piece may see, per document and in position
order (see ``Documents.visible_rows``), and makes one kernel call per piece: dense with
a bottom-right causal mask, or varlen for packed documents. The backward gathers K/V
again (nothing sequence-long is kept between forward and backward) and reduce-scatters
dK/dV in float32 to their owners. Simpler than p2p, at the price of holding the whole
K/V of ``Hkv / kv_head_chunks`` heads at once.
"""

from __future__ import annotations

import torch

from usp.comm import traced
from usp.comm.collectives import all_gather_into, reduce_scatter_into
from usp.kernels.masks import accumulation_dtype
from usp.ring.calls import calls_for
from usp.ring.config import PreparedRing


def head_chunks(num_kv_heads: int, chunks: int) -> list[tuple[int, int]]:
    if chunks < 1 or num_kv_heads % chunks:
        raise ValueError(
            f"kv_head_chunks={chunks} must be >= 1 and divide the local KV heads ({num_kv_heads})"
        )
    step = num_kv_heads // chunks
    return [(h, h + step) for h in range(0, num_kv_heads, step)]


def _placed_segments(cfg: PreparedRing):
    """The query pieces' segments: every key each piece sees, or with a window only the
    chunks it reaches (keys wholly outside it are neither selected nor computed)."""
    if cfg.window is not None:
        if torch.compiler.is_compiling():  # made when the call was prepared
            return cfg.placement.windows[cfg.window]
        return cfg.placement.window_segments(cfg.window)
    return cfg.placement.segments[cfg.causal]


def _segments(cfg: PreparedRing):
    """(query rows, rows of the gathered K/V they see, kernel calls) per query piece."""
    return [(seg.q_rows, seg.kv_rows, calls_for(cfg, seg.docs)) for seg in _placed_segments(cfg)]


def block_shapes(cfg: PreparedRing, local_len: int, heads: int, kv_heads: int) -> set[tuple]:
    """The (Sq, Sk, H, Hkv, causal, varlen) of every kernel call of this rank (one per
    query piece and group of KV heads)."""
    chunk_kv = kv_heads // cfg.kv_head_chunks
    chunk_heads = chunk_kv * (heads // kv_heads)
    rows = range(local_len)
    return {
        (
            len(rows[s.q_rows]),
            s.kv_rows.numel(),
            chunk_heads,
            chunk_kv,
            cfg.causal,
            s.docs is not None,
            cfg.window,
        )
        for s in _placed_segments(cfg)
    }


def _gather_kv(k, v, heads: slice, cfg: PreparedRing, after=None) -> torch.Tensor:
    """Local [B, L, Hkv, D] x2 -> every ring rank's K/V [2, B, r * L, hc, D], rank order.
    ``after``: in a compiled backward, the gradient the gather is tied to, so that it
    gathers again there (:func:`usp.comm.traced.stack_after`) instead of the forward's
    gathered K/V being saved for the backward."""
    if torch.compiler.is_compiling():  # a functional collective of the graph
        parts = [k[:, :, heads], v[:, :, heads]]
        local = torch.stack(parts) if after is None else traced.stack_after(parts, after)
        gathered = traced.all_gather(local, cfg.peers.name, cfg.size)
    else:
        local = torch.stack([k[:, :, heads], v[:, :, heads]])  # [2, B, L, hc, D]
        gathered = torch.empty(
            (cfg.size * 2,) + local.shape[1:], dtype=local.dtype, device=local.device
        )
        all_gather_into(gathered, local, cfg.group, cfg.stats)
    two, batch, local_len, hc, dim = local.shape
    by_rank = gathered.view(cfg.size, two, batch, local_len, hc, dim).permute(1, 2, 0, 3, 4, 5)
    return by_rank.reshape(two, batch, cfg.size * local_len, hc, dim)


def _scatter_grads(dkv: torch.Tensor, cfg: PreparedRing) -> torch.Tensor:
    """[2, B, r * L, hc, D] (rank order) -> this rank's summed share [2, B, L, hc, D]."""
    two, batch, total, hc, dim = dkv.shape
    local_len = total // cfg.size
    by_rank = (
        dkv.view(two, batch, cfg.size, local_len, hc, dim).permute(2, 0, 1, 3, 4, 5).contiguous()
    )
    full = by_rank.view(cfg.size * two, batch, local_len, hc, dim)
    if torch.compiler.is_compiling():
        return traced.reduce_scatter(full, cfg.peers.name, cfg.size)
    mine = torch.empty((two, batch, local_len, hc, dim), dtype=dkv.dtype, device=dkv.device)
    reduce_scatter_into(mine, full, cfg.group, cfg.stats)
    return mine


def allgather_forward(q, k, v, cfg: PreparedRing, documents=None):
    """``documents`` is not read: the all-gather ring's segments index the gathered K/V
    by document (sizes that depend on the packing), so its compiled graph is specialised
    to the packing ``cfg`` was placed for."""
    batch, local_len, heads, _ = q.shape
    group_size = heads // k.shape[2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, local_len), dtype=accumulation_dtype(q.dtype), device=q.device)
    segments = _segments(cfg)
    for h0, h1 in head_chunks(k.shape[2], cfg.kv_head_chunks):
        kv = _gather_kv(k, v, slice(h0, h1), cfg)
        q_heads = slice(h0 * group_size, h1 * group_size)
        for q_rows, kv_rows, calls in segments:
            visible = kv.index_select(2, kv_rows)  # [2, B, n, hc, D]
            seg_out, seg_lse = calls.forward(
                q[:, q_rows, q_heads], visible[0], visible[1], cfg.causal, cfg.window
            )
            out[:, q_rows, q_heads] = seg_out
            lse[:, q_heads, q_rows] = seg_lse
    return out, lse


def allgather_backward(dout, q, k, v, out, lse, cfg: PreparedRing, documents=None):
    group_size = q.shape[2] // k.shape[2]
    acc = accumulation_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    segments = _segments(cfg)
    for h0, h1 in head_chunks(k.shape[2], cfg.kv_head_chunks):
        kv = _gather_kv(k, v, slice(h0, h1), cfg, after=dout)
        q_heads = slice(h0 * group_size, h1 * group_size)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for q_rows, kv_rows, calls in segments:
            visible = kv.index_select(2, kv_rows)
            dq_seg, dk_seg, dv_seg = calls.backward(
                dout[:, q_rows, q_heads],
                q[:, q_rows, q_heads],
                visible[0],
                visible[1],
                out[:, q_rows, q_heads],
                lse[:, q_heads, q_rows],
                cfg.causal,
                cfg.window,
            )
            dq[:, q_rows, q_heads] = dq_seg
            dkv.index_add_(2, kv_rows, torch.stack([dk_seg, dv_seg]).to(acc))
        mine = _scatter_grads(dkv, cfg)
        dk[:, :, h0:h1] = mine[0]
        dv[:, :, h0:h1] = mine[1]
    return dq, dk, dv

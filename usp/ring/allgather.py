"""Ring attention by all-gathering K/V (optionally a few KV heads at a time).

Every rank gathers the K/V blocks of its ring group (in ring-rank order), selects for
each of its query pieces the keys that piece may see, per document and in position
order (see ``Documents.visible_rows``), and makes one kernel call per piece: dense with
a bottom-right causal mask, or varlen for packed documents. The backward gathers K/V
again (nothing sequence-long is kept between forward and backward) and reduce-scatters
dK/dV in float32 to their owners. Simpler than p2p, at the price of holding the whole
K/V of ``Hkv / kv_head_chunks`` heads at once.

With a sliding window a rank gathers only the rows of the other blocks that some
window reaches (the last keys of each chunk, :class:`usp.ring.placement.WindowGather`),
the same number from every rank, and reads its own block from its local K/V; the
backward reduce-scatters the gradients of those rows only.
"""

from __future__ import annotations

import torch

from usp.comm import traced
from usp.comm.collectives import all_gather_into, reduce_scatter_into
from usp.kernels.masks import accumulation_dtype
from usp.ring import kv_message
from usp.ring.calls import calls_for
from usp.ring.config import PreparedRing
from usp.ring.placement import WindowGather


def head_chunks(num_kv_heads: int, chunks: int) -> list[tuple[int, int]]:
    if chunks < 1 or num_kv_heads % chunks:
        raise ValueError(
            f"kv_head_chunks={chunks} must be >= 1 and divide the local KV heads ({num_kv_heads})"
        )
    step = num_kv_heads // chunks
    return [(h, h + step) for h in range(0, num_kv_heads, step)]


def _window_gather(cfg: PreparedRing) -> WindowGather | None:
    """With a sliding window, what this rank gathers and the keys each query piece sees
    (:class:`usp.ring.placement.WindowGather`); None without one."""
    if cfg.window is None:
        return None
    if torch.compiler.is_compiling():  # made when the call was prepared
        return cfg.placement.windows[cfg.window]
    return cfg.placement.window_gather(cfg.window)


def _segments(cfg: PreparedRing, gather: WindowGather | None):
    """(query rows, rows of the gathered K/V they see, kernel calls) per query piece."""
    segments = cfg.placement.segments[cfg.causal] if gather is None else gather.segments
    return [(seg.q_rows, seg.kv_rows, calls_for(cfg, seg.docs)) for seg in segments]


def block_shapes(cfg: PreparedRing, local_len: int, heads: int, kv_heads: int) -> set[tuple]:
    """The (Sq, Sk, H, Hkv, causal, varlen) of every kernel call of this rank (one per
    query piece and group of KV heads)."""
    chunk_kv = kv_heads // cfg.kv_head_chunks
    chunk_heads = chunk_kv * (heads // kv_heads)
    rows = range(local_len)
    # built here, when the call is prepared (also while a graph is traced, where
    # :func:`_window_gather` only reads it: a compiled first call found none before)
    gather = None if cfg.window is None else cfg.placement.window_gather(cfg.window)
    segments = cfg.placement.segments[cfg.causal] if gather is None else gather.segments
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
        for s in segments
    }


def _local_kv(k, v, heads: slice, after=None) -> torch.Tensor:
    """[2, B, L, hc, D]: this rank's K and V of a group of heads. ``after``: in a compiled
    backward, the gradient the gather of it is tied to, so that it gathers again there
    (:func:`usp.comm.traced.stack_after`) instead of the forward's gathered K/V being
    saved for the backward."""
    parts = [k[:, :, heads], v[:, :, heads]]
    if after is not None and torch.compiler.is_compiling():
        return traced.stack_after(parts, after)
    return torch.stack(parts)


def _mla_dims(cfg: PreparedRing):
    """K's and V's own head sizes when they differ (MLA), else None."""
    dims = cfg.kv_dims
    return dims if dims is not None and dims.key_dim != dims.value_dim else None


def _gather_rows(local: torch.Tensor, cfg: PreparedRing) -> torch.Tensor:
    """[2, B, n, hc, D] on every rank -> [2, B, r * n, hc, D], in ring-rank order."""
    dims = _mla_dims(cfg)
    if dims is not None:  # MLA: the real columns only
        packed = kv_message.pack(dims, local)  # [N]
        if torch.compiler.is_compiling():  # a functional collective of the graph
            flat = traced.all_gather(packed, cfg.peers.name, cfg.size)
        else:
            flat = torch.empty(cfg.size * packed.numel(), dtype=packed.dtype, device=packed.device)
            all_gather_into(flat, packed, cfg.group, cfg.stats)
        gathered = kv_message.unpack(dims, flat.view(cfg.size, -1), (cfg.size, *local.shape))
    elif torch.compiler.is_compiling():
        gathered = traced.all_gather(local, cfg.peers.name, cfg.size)
    else:
        gathered = torch.empty(
            (cfg.size * 2,) + local.shape[1:], dtype=local.dtype, device=local.device
        )
        all_gather_into(gathered, local, cfg.group, cfg.stats)
    two, batch, rows, hc, dim = local.shape
    by_rank = gathered.view(cfg.size, two, batch, rows, hc, dim).permute(1, 2, 0, 3, 4, 5)
    return by_rank.reshape(two, batch, cfg.size * rows, hc, dim)


def _gather_kv(k, v, heads: slice, cfg: PreparedRing, gather, after=None) -> torch.Tensor:
    """Local [B, L, Hkv, D] x2 -> the K/V the segments index, [2, B, n, hc, D]: every
    ring rank's block (n = r * L, rank order), or with a window the rows of every rank
    that some window reaches, then this rank's own block (n = r * m + L; nothing is
    gathered when no window reaches another rank, m = 0)."""
    local = _local_kv(k, v, heads, after)
    if gather is None:
        return _gather_rows(local, cfg)
    if not gather.rows_per_rank:
        return local
    return torch.cat([_gather_rows(local.index_select(2, gather.send_rows), cfg), local], 2)


def _scatter_grads(dkv: torch.Tensor, cfg: PreparedRing) -> torch.Tensor:
    """[2, B, r * n, hc, D] (rank order) -> this rank's summed share [2, B, n, hc, D]."""
    two, batch, total, hc, dim = dkv.shape
    rows = total // cfg.size
    by_rank = dkv.view(two, batch, cfg.size, rows, hc, dim).permute(2, 0, 1, 3, 4, 5).contiguous()
    full = by_rank.view(cfg.size * two, batch, rows, hc, dim)
    dims = _mla_dims(cfg)
    if dims is not None:  # MLA: the real columns only
        packed = kv_message.pack(dims, by_rank).view(-1)  # [r * N], rank order
        if torch.compiler.is_compiling():
            mine = traced.reduce_scatter(packed, cfg.peers.name, cfg.size)
        else:
            mine = torch.empty(packed.numel() // cfg.size, dtype=dkv.dtype, device=dkv.device)
            reduce_scatter_into(mine, packed, cfg.group, cfg.stats)
        return kv_message.unpack(dims, mine, (two, batch, rows, hc, dim))
    if torch.compiler.is_compiling():
        return traced.reduce_scatter(full, cfg.peers.name, cfg.size)
    mine = torch.empty((two, batch, rows, hc, dim), dtype=dkv.dtype, device=dkv.device)
    reduce_scatter_into(mine, full, cfg.group, cfg.stats)
    return mine


def _own_grads(dkv: torch.Tensor, cfg: PreparedRing, gather) -> torch.Tensor:
    """dK/dV of the gathered K/V ([2, B, n, hc, D] as :func:`_gather_kv`'s) -> this
    rank's block's, summed over the ranks: reduce-scattered, or with a window the
    gathered rows' reduce-scattered and added to the rows this rank sent."""
    if gather is None:
        return _scatter_grads(dkv, cfg)
    sent = cfg.size * gather.rows_per_rank
    own = dkv[:, :, sent:]
    if sent:
        own.index_add_(2, gather.send_rows, _scatter_grads(dkv[:, :, :sent], cfg))
    return own


def allgather_forward(q, k, v, cfg: PreparedRing, documents=None):
    """``documents`` is not read: the all-gather ring's segments index the gathered K/V
    by document (sizes that depend on the packing), so its compiled graph is specialised
    to the packing ``cfg`` was placed for."""
    batch, local_len, heads, _ = q.shape
    group_size = heads // k.shape[2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, local_len), dtype=accumulation_dtype(q.dtype), device=q.device)
    gather = _window_gather(cfg)
    segments = _segments(cfg, gather)
    for h0, h1 in head_chunks(k.shape[2], cfg.kv_head_chunks):
        kv = _gather_kv(k, v, slice(h0, h1), cfg, gather)
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
    gather = _window_gather(cfg)
    segments = _segments(cfg, gather)
    for h0, h1 in head_chunks(k.shape[2], cfg.kv_head_chunks):
        kv = _gather_kv(k, v, slice(h0, h1), cfg, gather, after=dout)
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
        mine = _own_grads(dkv, cfg, gather)
        dk[:, :, h0:h1] = mine[0]
        dv[:, :, h0:h1] = mine[1]
    return dq, dk, dv

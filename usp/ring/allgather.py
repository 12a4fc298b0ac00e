"""Ring attention by all-gathering K/V (optionally a few KV heads at a time).

Every rank gathers the whole K/V of its ring group, puts the chunks in natural sequence
order, and runs one bottom-right-causal kernel call per contiguous run of its query
rows (1 for contiguous, 2 for zigzag). The backward gathers K/V again (nothing
sequence-long is kept between forward and backward) and reduce-scatters dK/dV in
float32 to their owners. Simpler than p2p and with one kernel call per segment, at the
price of holding the gathered K/V of ``Hkv / kv_head_chunks`` heads at once.
"""

from __future__ import annotations

import torch

from usp.comm.collectives import all_gather_into, reduce_scatter_into
from usp.kernels import attention_backward, attention_forward
from usp.kernels.masks import accumulation_dtype
from usp.ring.config import RingConfig
from usp.ring.layout import allgather_segments, natural_chunk_order


def head_chunks(num_kv_heads: int, chunks: int) -> list[tuple[int, int]]:
    if chunks < 1 or num_kv_heads % chunks:
        raise ValueError(
            f"kv_head_chunks={chunks} must be >= 1 and divide the local KV heads ({num_kv_heads})"
        )
    step = num_kv_heads // chunks
    return [(h, h + step) for h in range(0, num_kv_heads, step)]


def _chunk_index(cfg: RingConfig, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    order = natural_chunk_order(cfg.layout, cfg.size)
    ranks = torch.tensor([rank for rank, _ in order], device=device)
    pieces = torch.tensor([piece for _, piece in order], device=device)
    return ranks, pieces, 2 if cfg.layout == "zigzag" else 1


def _gather_kv(k, v, heads: slice, cfg: RingConfig) -> torch.Tensor:
    """Local [B, L, Hkv, D] x2 -> the ring's K/V [2, B, S, hc, D] in natural order."""
    local = torch.stack([k[:, :, heads], v[:, :, heads]])  # [2, B, L, hc, D]
    gathered = torch.empty((cfg.size * 2,) + local.shape[1:], dtype=local.dtype, device=local.device)
    all_gather_into(gathered, local, cfg.group, cfg.stats)
    ranks, pieces, per_rank = _chunk_index(cfg, k.device)
    two, batch, local_len, hc, dim = local.shape
    by_piece = gathered.view(cfg.size, two, batch, per_rank, local_len // per_rank, hc, dim)
    natural = by_piece[ranks, :, :, pieces]  # [n_chunks, 2, B, L/p, hc, D]
    return natural.permute(1, 2, 0, 3, 4, 5).reshape(two, batch, cfg.size * local_len, hc, dim)


def _scatter_grads(dkv_natural: torch.Tensor, cfg: RingConfig) -> torch.Tensor:
    """[2, B, S, hc, D] in natural order -> this rank's summed share [2, B, L, hc, D]."""
    ranks, pieces, per_rank = _chunk_index(cfg, dkv_natural.device)
    two, batch, total, hc, dim = dkv_natural.shape
    local_len = total // cfg.size
    chunks = dkv_natural.view(two, batch, len(ranks), local_len // per_rank, hc, dim).permute(2, 0, 1, 3, 4, 5)
    by_rank = torch.empty(
        (cfg.size, two, batch, per_rank, local_len // per_rank, hc, dim), dtype=chunks.dtype, device=chunks.device
    )
    by_rank[ranks, :, :, pieces] = chunks
    mine = torch.empty((two, batch, local_len, hc, dim), dtype=chunks.dtype, device=chunks.device)
    reduce_scatter_into(mine, by_rank.view(cfg.size * two, batch, local_len, hc, dim), cfg.group, cfg.stats)
    return mine


def allgather_forward(q, k, v, cfg: RingConfig):
    batch, local_len, heads, _ = q.shape
    group_size = heads // k.shape[2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, local_len), dtype=accumulation_dtype(q.dtype), device=q.device)
    segments = allgather_segments(cfg.layout, cfg.causal, cfg.rank, cfg.size, local_len)
    for h0, h1 in head_chunks(k.shape[2], cfg.kv_head_chunks):
        kv = _gather_kv(k, v, slice(h0, h1), cfg)
        q_heads = slice(h0 * group_size, h1 * group_size)
        for seg in segments:
            seg_out, seg_lse = attention_forward(
                q[:, seg.q_rows, q_heads], kv[0][:, : seg.kv_len], kv[1][:, : seg.kv_len],
                causal=cfg.causal, softmax_scale=cfg.softmax_scale, backend=cfg.backend,
            )
            out[:, seg.q_rows, q_heads] = seg_out
            lse[:, q_heads, seg.q_rows] = seg_lse
    return out, lse


def allgather_backward(dout, q, k, v, out, lse, cfg: RingConfig):
    local_len = q.shape[1]
    group_size = q.shape[2] // k.shape[2]
    acc = accumulation_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    segments = allgather_segments(cfg.layout, cfg.causal, cfg.rank, cfg.size, local_len)
    for h0, h1 in head_chunks(k.shape[2], cfg.kv_head_chunks):
        kv = _gather_kv(k, v, slice(h0, h1), cfg)
        q_heads = slice(h0 * group_size, h1 * group_size)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for seg in segments:
            rows = seg.q_rows
            dq_seg, dk_seg, dv_seg = attention_backward(
                dout[:, rows, q_heads], q[:, rows, q_heads], kv[0][:, : seg.kv_len], kv[1][:, : seg.kv_len],
                out[:, rows, q_heads], lse[:, q_heads, rows],
                causal=cfg.causal, softmax_scale=cfg.softmax_scale, backend=cfg.backend,
            )
            dq[:, rows, q_heads] = dq_seg
            dkv[0][:, : seg.kv_len] += dk_seg
            dkv[1][:, : seg.kv_len] += dv_seg
        mine = _scatter_grads(dkv, cfg)
        dk[:, :, h0:h1] = mine[0]
        dv[:, :, h0:h1] = mine[1]
    return dq, dk, dv

"""A ring pass per group of KV heads, so that its buffers exist for one group at a time.

Heads are independent in attention: the query heads ``[h0 * g, h1 * g)`` (g = H / Hkv)
read only the KV heads ``[h0, h1)``. Running the p2p ring (or the local kernel) once per
group of ``Hkv / chunks`` KV heads therefore computes exactly what one pass computes,
while the pass's float32 accumulators (dQ, the dK/dV ``own`` and ``travelling``
buffers, the forward's output and LSE), its K/V messages and its kernels' outputs are
``1 / chunks`` of their size. What it costs: ``chunks`` times the ring steps (each with
``1 / chunks`` of the bytes and of the work), contiguous copies of each group's inputs
(``1 / chunks`` of q, k, v, out and dout at a time), and the whole outputs (out, or dq,
dk, dv, in the inputs' dtype) held while the groups fill them.
"""

from __future__ import annotations

import torch

from usp.ring.allgather import head_chunks


def _groups(q: torch.Tensor, k: torch.Tensor, chunks: int):
    """(query-head slice, KV-head slice) per group."""
    per_kv = q.shape[2] // k.shape[2]  # query heads per KV head
    return [
        (slice(h0 * per_kv, h1 * per_kv), slice(h0, h1))
        for h0, h1 in head_chunks(k.shape[2], chunks)
    ]


def _part(x: torch.Tensor, heads: slice) -> torch.Tensor:
    return x[:, :, heads].contiguous()  # [B, L, h, D] -> [B, L, h/chunks, D]


def forward_by_heads(forward, q, k, v, cfg, documents=None):
    """``forward(q, k, v, cfg, documents) -> (out, lse)`` once per head group
    (``cfg.kv_head_chunks``): q [B, L, H, D], k/v [B, L, Hkv, D] -> out [B, L, H, D],
    lse [B, H, L]."""
    out = lse = None
    for q_heads, kv_heads in _groups(q, k, cfg.kv_head_chunks):
        part_out, part_lse = forward(
            _part(q, q_heads), _part(k, kv_heads), _part(v, kv_heads), cfg, documents
        )
        if out is None:
            out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
            lse = part_lse.new_empty((q.shape[0], q.shape[2], q.shape[1]))  # [B, H, L]
        out[:, :, q_heads] = part_out
        lse[:, q_heads] = part_lse
        del part_out, part_lse
    return out, lse


def backward_by_heads(backward, dout, q, k, v, out, lse, cfg, documents=None):
    """``backward(dout, q, k, v, out, lse, cfg, documents) -> (dq, dk, dv)`` once per
    head group."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for q_heads, kv_heads in _groups(q, k, cfg.kv_head_chunks):
        part = backward(
            _part(dout, q_heads), _part(q, q_heads), _part(k, kv_heads), _part(v, kv_heads),
            _part(out, q_heads), lse[:, q_heads].contiguous(), cfg, documents,
        )  # fmt: skip
        dq[:, :, q_heads], dk[:, :, kv_heads], dv[:, :, kv_heads] = part
        del part
    return dq, dk, dv

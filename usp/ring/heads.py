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

**Planning** (``representative_only``, decided by the caller with
:func:`usp.planning_mode.representative`: fake tensors inside ``usp plan``'s step): the
groups have one size (``head_chunks`` divides the KV heads evenly), what outlives a
group (the whole outputs) is allocated by the first group and written in place, and each
group's inputs, buffers and outputs are freed before the next starts. So every group
after the first holds the same live bytes at each of its points, and the first no more
(the whole outputs appear in it only after its pass), and the loop's memory peak is
reached in the first group or in the last: running those two gives the loop's peak byte
for byte (``tests/planner/test_planner_speed.py``), with a ring pass per layer instead
of one per group -- under fake tensors each op costs the same host time whatever its
size, and one KV head per ring pass made a planned step ``Hkv`` times the ring's ops.
The groups not run leave their slice of the outputs unwritten: fake tensors hold no
values.
"""

from __future__ import annotations

import torch

from usp.ring.allgather import head_chunks


def _groups(q: torch.Tensor, k: torch.Tensor, chunks: int, representative_only: bool = False):
    """(query-head slice, KV-head slice) per group; ``representative_only``: the first
    and the last group only (see the module docstring)."""
    per_kv = q.shape[2] // k.shape[2]  # query heads per KV head
    groups = [
        (slice(h0 * per_kv, h1 * per_kv), slice(h0, h1))
        for h0, h1 in head_chunks(k.shape[2], chunks)
    ]
    if representative_only and len(groups) > 2:
        return [groups[0], groups[-1]]
    return groups


def _part(x: torch.Tensor, heads: slice) -> torch.Tensor:
    return x[:, :, heads].contiguous()  # [B, L, h, D] -> [B, L, h/chunks, D]


def forward_by_heads(forward, q, k, v, cfg, documents=None, *, representative_only=False):
    """``forward(q, k, v, cfg, documents) -> (out, lse)`` once per head group
    (``cfg.kv_head_chunks``): q [B, L, H, D], k/v [B, L, Hkv, D] -> out [B, L, H, D],
    lse [B, H, L]. ``representative_only``: a planned step's first and last group (see
    the module docstring)."""
    out = lse = None
    for q_heads, kv_heads in _groups(q, k, cfg.kv_head_chunks, representative_only):
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


def backward_by_heads(
    backward, dout, q, k, v, out, lse, cfg, documents=None, *, representative_only=False
):
    """``backward(dout, q, k, v, out, lse, cfg, documents) -> (dq, dk, dv)`` once per
    head group (``representative_only``: as :func:`forward_by_heads`)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for q_heads, kv_heads in _groups(q, k, cfg.kv_head_chunks, representative_only):
        part = backward(
            _part(dout, q_heads), _part(q, q_heads), _part(k, kv_heads), _part(v, kv_heads),
            _part(out, q_heads), lse[:, q_heads].contiguous(), cfg, documents,
        )  # fmt: skip
        dq[:, :, q_heads], dk[:, :, kv_heads], dv[:, :, kv_heads] = part
        del part
    return dq, dk, dv

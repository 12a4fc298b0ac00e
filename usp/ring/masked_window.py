"""A windowed block of packed documents computed inside a compiled graph.

Eagerly a windowed block between two pieces runs one kernel call per document
(:class:`usp.ring.window.WindowDocuments`), sized by the packing's host ints; a compiled
graph serves every packing of a shape, so here the block is one masked attention whose
mask is built from the piece's document boundaries on the device (``cu`` int32 [N+1],
the same for the query and the key piece):

    same document  and  key_pos <= q_pos  and  key_pos >= q_pos - w

with positions relative to the document: a query row at offset i of its document's
chunk of n tokens sits at ``i + delta * n`` (its chunk is ``delta`` chunks after the
key piece's). Exact (the same scores as the kernels), not fast: the block is
materialised as [H, Lq, Lk] scores. Rows no key reaches get out = 0, lse = -inf.
"""

from __future__ import annotations

import torch

from usp.kernels.masks import accumulation_dtype


def window_mask(cu: torch.Tensor, rows: int, delta: int, w: int) -> torch.Tensor:
    """bool [rows, rows]: query row (dim 0) of a piece sees key row (dim 1) of a piece
    ``delta`` chunks before it, with left window ``w``."""
    bounds = cu.to(torch.int64)
    index = torch.arange(rows, device=cu.device)
    doc = torch.searchsorted(bounds[1:], index, right=True)  # [rows] document of each row
    start = bounds[doc]
    local = index - start  # position in the document's chunk
    q_pos = local + delta * (bounds[doc + 1] - start)
    same = doc[:, None] == doc[None, :]
    offset = q_pos[:, None] - local[None, :]  # query position minus key position
    return same & (offset >= 0) & (offset <= w)


def _heads(t: torch.Tensor, heads: int, dtype) -> torch.Tensor:
    """[1, L, h, D] -> [heads, L, D], repeating grouped K/V heads."""
    t = t[0].transpose(0, 1).to(dtype)
    return t.repeat_interleave(heads // t.shape[0], dim=0) if t.shape[0] != heads else t


def _probs(q, k, mask, scale, lse=None):
    """Masked scores' probabilities [H, Lq, Lk] (against ``lse`` when given) and lse."""
    dtype = accumulation_dtype(q.dtype)
    qh, kh = _heads(q, q.shape[2], dtype), _heads(k, q.shape[2], dtype)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf for rows with no key
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.where(mask, torch.exp(scores - finite[..., None]), torch.zeros_like(scores))
    return probs, lse, qh, kh


def masked_forward(q, k, v, cu, delta: int, w: int, scale: float):
    """(out [1, Lq, H, D], lse [1, H, Lq]) of the block."""
    mask = window_mask(cu, q.shape[1], delta, w)
    probs, lse, _, _ = _probs(q, k, mask, scale)
    vh = _heads(v, q.shape[2], probs.dtype)
    out = (probs @ vh).transpose(0, 1)[None].to(q.dtype)
    return out, lse[None]


def masked_backward(dout, q, k, v, out, lse, cu, delta: int, w: int, scale: float):
    """(dq, dk, dv) of the block against the call's (merged) ``out`` and ``lse``."""
    heads, kv_heads = q.shape[2], k.shape[2]
    mask = window_mask(cu, q.shape[1], delta, w)
    probs, _, qh, kh = _probs(q, k, mask, scale, lse[0].to(accumulation_dtype(q.dtype)))
    dtype = probs.dtype
    vh, do = _heads(v, heads, dtype), _heads(dout, heads, dtype)
    rowsum = (do * _heads(out, heads, dtype)).sum(-1)  # [H, Lq]
    dp = do @ vh.transpose(-1, -2)
    ds = probs * (dp - rowsum[..., None])
    dq = (ds @ kh) * scale
    dk = (ds.transpose(-1, -2) @ qh) * scale
    dv = probs.transpose(-1, -2) @ do

    def back(g, h, like):  # [H, L, D] -> [1, L, h, D], summing grouped heads
        g = g.reshape(h, heads // h, *g.shape[1:]).sum(1)
        return g.transpose(0, 1)[None].to(like.dtype)

    return back(dq, heads, q), back(dk, kv_heads, k), back(dv, kv_heads, v)

"""Gemma 3's bidirectional image blocks under USP attention, exact under SP.

Gemma 3's ``token_type_ids`` make every image's tokens (a run of type 1) see each other:
its mask is causal attention plus, for a token of a block, the block's *later* tokens
(transformers' ``blockwise_overlay``; a sliding layer's window only limits the past, so
the later tokens stay visible there too). USP attention computes the causal part (the
ring, with the layer's window); :func:`block_partial` computes the later keys' part for
this rank's image tokens, ``(out, lse)``, which the ring merges as one more block
(:mod:`usp.ring.partial`).

A block held whole by this rank needs nothing from the others. Blocks that a layout
chunk boundary splits over ranks ("shared" blocks) are completed by one all-gather of
their K/V rows per layer (gradients reduce-scattered back): images are short and chunk
boundaries few, so the gathered rows are a small part of the sequence. The index tables
are worked out once per batch on the host (:func:`image_blocks`), the same on every rank.
Memory per layer: [local blocks, heads, L, L] scores, L the longest image (256 tokens a
Gemma 3 image).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.comm.collectives import all_gather_uncounted
from usp.kernels.masks import accumulation_dtype
from usp.linear.ring import ring_all_gather


@dataclass(frozen=True)
class ImageBlocks:
    """This rank's view of a global batch's image blocks (:func:`image_blocks`).

    ``query_rows`` [N, L]: for each block with a token here (longest L), the row of its
    j-th token in this rank's flattened [B * S/P] rows, -1 where that token is elsewhere
    or past the block's end. ``key_rows`` [N, L]: where its j-th token's K/V are: a local
    row, or ``B * S/P +`` a row of the gathered shared rows; -1 past the block's end.
    ``shared_rows`` [n]: the local rows this rank contributes to the gather (padded to
    ``shared_max`` rows on every rank; 0: nothing is gathered)."""

    query_rows: torch.Tensor
    key_rows: torch.Tensor
    shared_rows: torch.Tensor
    shared_max: int
    group: object = None


def block_spans(token_types: torch.Tensor, bounds: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of type-1 tokens of one row (``token_types`` [S]), cut at the
    documents' ``bounds`` (a block never spans two documents); runs of one token (no
    later key) are left out."""
    flags = token_types.to("cpu").eq(1).tolist()
    cuts = set(bounds)
    spans, start = [], None
    for i, flag in enumerate([*flags, False]):
        if start is not None and (not flag or i in cuts):
            if i - start > 1:
                spans.append((start, i))
            start = None
        if flag and start is None:
            start = i
    return spans


def image_blocks(
    spans: list[list[tuple[int, int]]], every_rank_tokens: torch.Tensor, me: int, group
) -> ImageBlocks:
    """The index tables of :class:`ImageBlocks` for group rank ``me``. ``spans``: each
    row's blocks (:func:`block_spans`); ``every_rank_tokens`` [P, S/P]: the global
    positions every group rank holds, in local order (the same for every row)."""
    ranks, local_len = every_rank_tokens.shape
    seq = ranks * local_len
    owner = torch.empty(seq, dtype=torch.long)  # global position -> group rank
    slot = torch.empty(seq, dtype=torch.long)  # global position -> local position there
    owner[every_rank_tokens.reshape(-1)] = torch.arange(ranks).repeat_interleave(local_len)
    slot[every_rank_tokens.reshape(-1)] = torch.arange(local_len).repeat(ranks)
    shared: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]  # (row, position)
    for row, row_spans in enumerate(spans):
        for a, b in row_spans:
            holders = owner[a:b]
            if bool((holders != holders[0]).any()):
                for pos in range(a, b):
                    shared[int(owner[pos])].append((row, pos))
    shared_max = max(len(s) for s in shared)
    gathered_slot = {
        item: r * shared_max + j for r, s in enumerate(shared) for j, item in enumerate(s)
    }
    queries, keys = [], []
    for row, row_spans in enumerate(spans):
        for a, b in row_spans:
            holders = owner[a:b].tolist()
            if me not in holders:
                continue
            here = [h == me for h in holders]
            local = [row * local_len + int(slot[pos]) for pos in range(a, b)]
            queries.append([rows if mine else -1 for rows, mine in zip(local, here)])
            keys.append(
                [
                    rows if mine else len(spans) * local_len + gathered_slot[(row, pos)]
                    for rows, mine, pos in zip(local, here, range(a, b))
                ]
            )
    longest = max((len(q) for q in queries), default=0)

    def padded(lists):
        table = [rows + [-1] * (longest - len(rows)) for rows in lists]
        return torch.tensor(table, dtype=torch.long).reshape(len(table), longest)

    query_rows, key_rows = padded(queries), padded(keys)
    mine = [row * local_len + int(slot[pos]) for row, pos in shared[me]]
    return ImageBlocks(
        query_rows, key_rows, torch.tensor(mine, dtype=torch.long), shared_max, group
    )


def block_partial(blocks: ImageBlocks, q, k, v, scaling: float | None, stats=None):
    """The attention of this rank's image tokens to their blocks' later tokens: q [B,
    S/P, H, D], k/v [B, S/P, Hkv, D] (this rank's shard, after RoPE) -> (out [B, S/P, H,
    D], lse [B, S/P, H]); rows outside blocks get out 0 and lse -inf (nothing to merge).
    Collective over the SP group when blocks are shared (every rank calls it)."""
    batch, local_len, heads, dim = q.shape
    acc = accumulation_dtype(q.dtype)
    rows = batch * local_len
    kv = torch.cat([k, v], dim=-1).reshape(rows, k.shape[2], 2 * dim)  # [B*S/P, Hkv, 2D]
    tie = None
    if blocks.shared_max:
        send = kv.new_zeros(blocks.shared_max, *kv.shape[1:])
        send = send.index_copy(0, torch.arange(len(blocks.shared_rows), device=kv.device),
                               kv[blocks.shared_rows.to(kv.device)])  # fmt: skip
        gathered = ring_all_gather(send, blocks.group, stats)  # [P, n, Hkv, 2D]
        gathered = gathered.reshape(-1, *kv.shape[1:])
        kv = torch.cat([kv, gathered])
        tie = gathered[:0].sum()  # every rank's gather is in its graph: all reach its backward
    out = q.new_zeros(rows, heads, dim, dtype=acc)
    lse = q.new_full((rows, heads), float("-inf"), dtype=acc)
    if blocks.query_rows.shape[0]:
        query_rows = blocks.query_rows.to(q.device)
        key_rows = blocks.key_rows.to(q.device)
        block_out, block_lse = _later_keys(q.reshape(rows, heads, dim), kv, query_rows, key_rows,
                                           scaling, acc)  # fmt: skip
        valid = query_rows >= 0
        out = out.index_put((query_rows[valid],), block_out[valid])
        lse = lse.index_put((query_rows[valid],), block_lse[valid])
    if tie is not None:
        lse = lse + tie.to(acc)
    return out.reshape(batch, local_len, heads, dim).to(q.dtype), lse.reshape(
        batch, local_len, heads
    )


def _later_keys(q_rows, kv, query_rows, key_rows, scaling, acc):
    """Per block [N, L]: each valid query's attention to the block's later valid keys
    -> (out [N, L, H, D], lse [N, L, H]) in ``acc``."""
    heads, dim = q_rows.shape[1], q_rows.shape[2]
    q = q_rows[query_rows.clamp(min=0)].to(acc)  # [N, L, H, D]
    kv = kv[key_rows.clamp(min=0)].to(acc)  # [N, L, Hkv, 2D]
    groups = heads // kv.shape[2]
    k, v = kv[..., :dim].repeat_interleave(groups, 2), kv[..., dim:].repeat_interleave(groups, 2)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * scale  # [N, H, L, L]
    length = query_rows.shape[1]
    later = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)  # key > query
    seen = later & (key_rows >= 0)[:, None, :] & (query_rows >= 0)[:, :, None]  # [N, L, L]
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    top = scores.detach().amax(dim=-1, keepdim=True)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)  # 0 where not seen
    total = weights.sum(dim=-1)  # [N, H, L]; 0 where no later key
    none = total == 0
    safe = torch.where(none, torch.ones_like(total), total)  # no 0 in a gradient's division
    lse = torch.where(none, torch.full_like(total, float("-inf")), safe.log() + top[..., 0])
    out = torch.einsum("nhqk,nkhd->nqhd", weights / safe[..., None], v)
    return out, lse.transpose(1, 2)


def every_rank_tokens(plan, seq_len: int, packed) -> torch.Tensor:
    """[P, S/P]: the global positions each SP group rank holds (group-rank order, what the
    block gather follows). One all-gather of this rank's positions."""
    mine = plan.token_indices(seq_len, packed=packed)
    group = plan.sp_group
    if plan.sp_degree == 1:
        return mine[None]
    every = mine.new_empty(plan.sp_degree * mine.shape[0])
    all_gather_uncounted(every, mine, group)  # bookkeeping: not the model's traffic
    return every.reshape(plan.sp_degree, -1)

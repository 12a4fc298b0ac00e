"""Ring attention with point-to-point K/V passing, double buffered.

Forward: at each of the r steps, post the send of the K/V block we hold to the next
rank (and the receive of the previous rank's) before computing on it, so the transfer
overlaps the kernel. Partial results merge by LSE in float32.

Backward: K/V circulate again; each block's dK/dV accumulator (float32) starts at the
owner's next rank, travels one step behind the K/V, collects every other rank's
contribution and reaches the owner after r-1 hops, who adds its own. dQ accumulates
locally in float32.
"""

from __future__ import annotations

import torch

from usp.comm.ring_exchange import RingExchange
from usp.kernels import merge_into
from usp.kernels.masks import accumulation_dtype
from usp.ring.calls import calls_for
from usp.ring.config import RingConfig
from usp.ring.layout import ALL, packed_step_blocks, step_blocks


def _kv_rank(ring: RingExchange, step: int) -> int:
    return (ring.rank - step) % ring.size


def _plan(cfg: RingConfig, local_len: int):
    """(blocks of a step, the kernel calls that compute them) for dense or packed input."""
    if not cfg.packed:
        return (lambda i, j: step_blocks(cfg.layout, cfg.causal, i, j, local_len)), calls_for(
            cfg, None
        )
    piece_len = cfg.placement.documents.piece_len
    blocks = lambda i, j: packed_step_blocks(cfg.layout, cfg.causal, i, j, piece_len)  # noqa: E731
    return blocks, calls_for(cfg, cfg.placement.piece_docs)


def p2p_forward(q, k, v, cfg: RingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, L, H, D], k/v [B, L, Hkv, D] (local) -> out [B, L, H, D], lse [B, H, L]."""
    ring = RingExchange(cfg.group, cfg.stats)
    acc = accumulation_dtype(q.dtype)
    kv = torch.stack([k, v])  # [2, B, L, Hkv, D]: one message per step
    spare = torch.empty_like(kv) if ring.size > 1 else None
    blocks, calls = _plan(cfg, q.shape[1])
    out = lse = None  # float32 accumulators [B, L, H, D] and [B, H, L]
    for step in range(ring.size):
        pending = ring.start(kv, spare) if step + 1 < ring.size else None
        for block in blocks(ring.rank, _kv_rank(ring, step)):
            block_out, block_lse = calls.forward(
                _rows(q, block.q_rows), _rows(kv[0], block.kv_rows), _rows(kv[1], block.kv_rows),
                block.causal,
            )  # fmt: skip
            if out is None and block.q_rows == ALL:  # the first block sees every row: start there
                out, lse = block_out.to(acc, copy=True), block_lse.to(acc, copy=True)
            else:
                if out is None:
                    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
                    lse = torch.full(lse_shape(q), float("-inf"), dtype=acc, device=q.device)
                merge_into(out[:, block.q_rows], lse[:, :, block.q_rows], block_out, block_lse)
            del block_out, block_lse  # merged: not alive during the next block's kernel
        if pending is not None:
            spare, kv = kv, pending.wait()  # our send finished too: reuse its buffer
            if step + 2 >= ring.size:
                spare = None  # no receive left to post into it
    del kv
    return out.to(q.dtype), lse


def lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """[B, L, H, D] -> the LSE's [B, H, L]."""
    return (q.shape[0], q.shape[2], q.shape[1])


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """``x[:, rows]`` without making a view for all rows."""
    return x if rows == ALL else x[:, rows]


def _add_block_grads(dkv: torch.Tensor, block_grads) -> None:
    """dkv [2, B, L, Hkv, D] += one step's (kv_rows, dk, dv) blocks (a function of its
    own, so that no loop variable keeps the last block alive into the next step)."""
    for kv_rows, dk_block, dv_block in block_grads:
        _rows(dkv[0], kv_rows).add_(dk_block)
        _rows(dkv[1], kv_rows).add_(dv_block)


def p2p_backward(dout, q, k, v, out, lse, cfg: RingConfig):
    """Gradients of :func:`p2p_forward`. Every buffer is dropped as soon as nothing reads
    it any more (a block's kernel outputs once added, the spare K/V buffer once no
    receive is left, the accumulators before the casts at the end), so that at most
    the float32 dQ, ``own`` and two ``travelling`` dK/dV accumulators, two K/V blocks and
    one step's kernel outputs are alive at once."""
    ring = RingExchange(cfg.group, cfg.stats)
    local_len = q.shape[1]
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    kv_spare = torch.empty_like(kv) if ring.size > 1 else None
    # dK/dV in float32: ``own`` keeps this rank's contribution to its own block (step 0);
    # the accumulator of every other block starts at the owner's next rank, collects
    # one contribution per step, and reaches the owner after r-1 hops. Two buffers
    # (from step 1 on): the accumulator being added to and sent, and the one the next
    # arrives in.
    own = torch.zeros((2,) + k.shape, dtype=acc, device=k.device)
    travelling: list[torch.Tensor | None] = [None, None]
    current, dkv_pending = 0, None
    blocks, calls = _plan(cfg, local_len)
    for step in range(ring.size):
        kv_pending = ring.start(kv, kv_spare) if step + 1 < ring.size else None
        block_grads = []
        for block in blocks(ring.rank, _kv_rank(ring, step)):
            rows, kv_rows = block.q_rows, block.kv_rows
            dq_block, dk_block, dv_block = calls.backward(
                _rows(dout, rows), _rows(q, rows), _rows(kv[0], kv_rows), _rows(kv[1], kv_rows),
                _rows(out, rows), lse if rows == ALL else lse[:, :, rows], block.causal,
            )  # fmt: skip
            _rows(dq, rows).add_(dq_block)
            del dq_block  # added: not alive during the next block's kernel
            block_grads.append((block.kv_rows, dk_block, dv_block))
            del dk_block, dv_block
        if step == 0:
            dkv = own
        elif step == 1:
            travelling = [torch.zeros_like(own), torch.empty_like(own)]
            dkv = travelling[current]
        else:
            dkv_pending.wait()  # this block's accumulator arrived in travelling[current]
            dkv = travelling[current]
        _add_block_grads(dkv, block_grads)
        del block_grads
        if step > 0:
            dkv_pending = ring.start(dkv, travelling[1 - current])
            current = 1 - current
        del dkv
        if kv_pending is not None:
            kv_spare, kv = kv, kv_pending.wait()
            if step + 2 >= ring.size:
                kv_spare = None  # no receive left to post into it
    del kv
    if dkv_pending is not None:
        dkv_pending.wait()  # everyone else's contributions to this rank's block
        own += travelling[current]
    del travelling, dkv_pending
    # copies even for float32: dk and dv must not be views of one shared buffer
    dk, dv = own[0].to(k.dtype, copy=True), own[1].to(v.dtype, copy=True)
    del own
    return dq.to(q.dtype), dk, dv

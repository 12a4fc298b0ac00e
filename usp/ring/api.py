"""``ring_attention``: exact attention over a sequence sharded across a ring group."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_uncounted
from usp.comm.stats import CommStats
from usp.kernels.spec import validate_cu_seqlens, validate_inputs
from usp.ring.allgather import allgather_backward, allgather_forward, head_chunks
from usp.ring.calls import DenseCalls
from usp.ring.config import RING_IMPLS, RingConfig
from usp.ring.documents import Documents, check_layout
from usp.ring.layout import required_local_multiple
from usp.ring.p2p import p2p_backward, p2p_forward


class RingInputError(ValueError):
    """The inputs of a ring-attention call do not fit its group or layout."""


def _local_forward(q, k, v, cfg: RingConfig):
    """Ring of one with a dense sequence: the local kernel, no communication at all."""
    return DenseCalls(cfg.softmax_scale, cfg.backend).forward(q, k, v, cfg.causal)


def _local_backward(dout, q, k, v, out, lse, cfg: RingConfig):
    return DenseCalls(cfg.softmax_scale, cfg.backend).backward(dout, q, k, v, out, lse, cfg.causal)


def _implementation(cfg: RingConfig):
    """(forward, backward) for this call: local, p2p ring or all-gather ring. A ring of
    one with packed documents still runs the p2p plan (it never sends anything)."""
    if cfg.size == 1 and cfg.documents is None:
        return _local_forward, _local_backward
    if cfg.ring_impl == "p2p":
        return p2p_forward, p2p_backward
    return allgather_forward, allgather_backward


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: RingConfig, q, k, v):
        out, lse = _implementation(cfg)[0](q, k, v, cfg)
        ctx.mark_non_differentiable(lse)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _implementation(ctx.cfg)[1](dout.contiguous(), q, k, v, out, lse, ctx.cfg)
        return None, dq, dk, dv


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "zigzag",
    ring_impl: str = "p2p",
    backend: str = "auto",
    comm_stats: CommStats | None = None,
    kv_head_chunks: int = 1,
    return_lse: bool = False,
    check_shapes: bool | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """Attention over the whole sequence held, sharded, by the ranks of ``group``.

    q [B, L, H, D], k/v [B, L, Hkv, D]: this rank's L = S / r tokens in ``layout``
    (see :mod:`usp.ring.layout`; use :func:`usp.shard_sequence` to place them).
    Returns out [B, L, H, D] (and lse [B, H, L] in float32 when ``return_lse``).
    ``cu_seqlens`` (int32 [N+1], identical on every rank) are the document boundaries
    of the *global* packed sequence (batch 1): attention is then block-diagonal by
    document, each document placed as :mod:`usp.ring.documents` describes.
    Only the Hkv K/V heads travel. ``check_shapes`` (default: on for gloo groups, where
    it costs nothing measurable) compares shapes across the ring before communicating.
    """
    check_layout(layout)
    if ring_impl not in RING_IMPLS:
        raise RingInputError(f"unknown ring_impl {ring_impl!r}; valid: {', '.join(RING_IMPLS)}")
    validate_inputs(q, k, v, causal=causal, window=None)
    cfg = RingConfig(
        group, causal, softmax_scale, layout, ring_impl, backend, comm_stats, kv_head_chunks
    )
    _check_group_inputs(q, k, cfg, check_shapes)
    if cu_seqlens is not None:
        cfg = dataclasses.replace(cfg, documents=packed_documents(cu_seqlens, q, cfg.size, layout))
    out, lse = _RingAttention.apply(cfg, q, k, v)
    return (out, lse) if return_lse else out


def packed_documents(cu_seqlens, q, ring_size: int, layout: str) -> Documents:
    """Validate global document boundaries against this rank's q [1, L, H, D]."""
    if q.shape[0] != 1:
        raise RingInputError(f"packed sequences (cu_seqlens) need batch size 1, got {q.shape[0]}")
    total = q.shape[1] * ring_size
    try:
        bounds = validate_cu_seqlens(cu_seqlens, total, "cu_seqlens")
    except ValueError as err:
        raise RingInputError(f"{err} (the global packed sequence has {total} tokens)") from None
    return Documents.from_bounds(bounds, ring_size, layout)


def _check_group_inputs(q, k, cfg: RingConfig, check_shapes: bool | None) -> None:
    if q.shape[1] != k.shape[1]:
        raise RingInputError(
            f"ring attention needs q and k/v with the same local sequence length, got {q.shape[1]} and {k.shape[1]}"
        )
    multiple = required_local_multiple(cfg.layout, cfg.causal)
    if q.shape[1] % multiple:
        raise RingInputError(
            f"the {cfg.layout} layout needs the local sequence length to be a multiple of {multiple} "
            f"(global length a multiple of {multiple * cfg.size} on a ring of {cfg.size}), got {q.shape[1]}"
        )
    if cfg.ring_impl == "allgather":
        try:
            head_chunks(k.shape[2], cfg.kv_head_chunks)
        except ValueError as err:
            raise RingInputError(str(err)) from None
    backend = dist.get_backend(cfg.group)
    if backend == "nccl" and q.device.type != "cuda":
        raise RingInputError(
            f"the ring group uses NCCL, which needs CUDA tensors; got tensors on {q.device}"
        )
    if backend == "gloo" and q.device.type != "cpu":
        raise RingInputError(
            f"the ring group uses gloo; pass CPU tensors (got {q.device}) or use an NCCL group"
        )
    if check_shapes is None:  # one tiny collective: free on gloo, a host sync on NCCL
        check_shapes = backend == "gloo"
    if check_shapes and cfg.size > 1:
        _check_same_shapes(q, k, cfg)


def _check_same_shapes(q, k, cfg: RingConfig) -> None:
    mine = torch.tensor([[*q.shape, *k.shape]], dtype=torch.int64, device=q.device)
    every = torch.empty((cfg.size, mine.shape[1]), dtype=torch.int64, device=q.device)
    all_gather_uncounted(every, mine, cfg.group)
    shapes = [tuple(row) for row in every.tolist()]
    if len(set(shapes)) > 1:
        described = ", ".join(f"ring rank {i}: q {s[:4]} k {s[4:]}" for i, s in enumerate(shapes))
        raise RingInputError(f"ring ranks hold differently shaped inputs: {described}")

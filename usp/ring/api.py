"""``ring_attention``: exact attention over a sequence sharded across a ring group."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from usp.comm.agreement import Field
from usp.comm.call_check import (
    call_fields,
    checked_call,
    documents_field,
    grad_field,
    grad_mask,
)
from usp.comm.stats import CommStats
from usp.comm.traced import TracedGroup
from usp.errors import InputError
from usp.kernels.backends.registry import KernelRegistry
from usp.kernels.docs import DeviceBounds
from usp.kernels.spec import (
    AttentionInputError,
    AttentionSpec,
    BackendUnavailableError,
    default_scale,
    validate_cu_seqlens,
    validate_inputs,
)
from usp.options import BACKENDS, LAYOUTS, RING_IMPLS, check_choice
from usp.planning_mode import representative
from usp.ring.allgather import allgather_backward, allgather_forward, head_chunks
from usp.ring.allgather import block_shapes as allgather_block_shapes
from usp.ring.calls import BlockKernels, calls_for
from usp.ring.config import PreparedRing
from usp.ring.documents import DocumentLayoutError, Documents
from usp.ring.heads import backward_by_heads, forward_by_heads
from usp.ring.kv_message import KVDims
from usp.ring.layout import required_local_multiple
from usp.ring.p2p import block_shapes as p2p_block_shapes
from usp.ring.p2p import p2p_backward, p2p_forward
from usp.ring.partial import merge_partial, partial_grads
from usp.ring.placement import (
    RankPlacement,
    dense_placement,
    packed_placement,
    single_rank_placement,
)
from usp.ring.sinks import apply_sinks, sinks_grad


class RingInputError(InputError):
    """The inputs of a ring-attention call do not fit its group or layout."""


def _local_forward(q, k, v, cfg: PreparedRing, documents=None):
    """Ring of one with a dense sequence: the local kernel, no communication at all."""
    return calls_for(cfg, None).forward(q, k, v, cfg.causal, cfg.window)


def _local_backward(dout, q, k, v, out, lse, cfg: PreparedRing, documents=None):
    return calls_for(cfg, None).backward(dout, q, k, v, out, lse, cfg.causal, cfg.window)


def _implementation(cfg: PreparedRing, representative_only: bool = False):
    """(forward, backward) for this call: local, p2p ring or all-gather ring. A ring of
    one with packed documents runs the p2p plan whatever ``ring_impl`` says (it never
    sends anything; there is nothing to gather). With ``kv_head_chunks`` > 1 the local
    and p2p passes run once per group of KV heads (:mod:`usp.ring.heads`; a planned
    step's first and last group with ``representative_only``); the all-gather ring
    chunks its gathers itself."""
    if cfg.size == 1 and not cfg.packed:
        forward, backward = _local_forward, _local_backward
    elif cfg.ring_impl == "p2p" or cfg.size == 1:
        forward, backward = p2p_forward, p2p_backward
    else:
        return allgather_forward, allgather_backward
    if cfg.kv_head_chunks > 1:
        only = {"representative_only": representative_only}
        return (
            partial(forward_by_heads, forward, **only),
            partial(backward_by_heads, backward, **only),
        )
    return forward, backward


class _NoSecondDerivative(torch.autograd.Function):
    """Passes first-order gradients through; differentiating them again raises.

    Connected to the first backward's inputs (so that a double backward reaches it and
    raises, on every rank at the same point) rather than to detached leaves."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.detach() if t is not None else None for t in tensors[:3])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "usp attention does not support second derivatives (double backward through "
            "attention, e.g. create_graph=True followed by another backward through its "
            "gradients): its backward is a hand-written ring/all-to-all pass"
        )


def _device_bounds(boundaries, longest) -> DeviceBounds | None:
    """The piece-vs-piece documents of a compiled graph (None eagerly): the boundaries
    for query and key pieces alike, and the longest document (a symbolic size)."""
    if boundaries is None:
        return None
    return DeviceBounds(boundaries, boundaries, longest, longest)


class _RingAttention(torch.autograd.Function):
    """(out, lse) of a validated ring call; with ``sinks`` ([h], this rank's heads) the
    rescaled output and the LSE with the sinks' column (:mod:`usp.ring.sinks`), which
    the ring's backward then uses as they are."""

    @staticmethod
    def forward(ctx, cfg: PreparedRing, q, k, v, boundaries, longest, sinks, p_out, p_lse):
        documents = _device_bounds(boundaries, longest)
        # decided here and kept for the backward, which may run on another thread
        ctx.representative = representative(q)  # (usp plan's fake step: usp.ring.heads)
        out, lse = _implementation(cfg, ctx.representative)[0](q, k, v, cfg, documents)
        if p_out is not None:  # a partial result over more keys (usp.ring.partial)
            out, lse = merge_partial(out, lse, p_out, p_lse)
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks)
        ctx.mark_non_differentiable(lse)
        ctx.cfg, ctx.longest = cfg, longest
        ctx.save_for_backward(q, k, v, out, lse, boundaries, sinks, p_out, p_lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, boundaries, sinks, p_out, p_lse = ctx.saved_tensors
        documents = _device_bounds(boundaries, ctx.longest)
        dsinks = d_p_out = d_p_lse = None
        with torch.no_grad():
            backward = _implementation(ctx.cfg, ctx.representative)[1]
            dout = dout.contiguous()
            dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.cfg, documents)
            if sinks is not None and ctx.needs_input_grad[6]:
                dsinks = sinks_grad(dout, out, lse, sinks)
            if p_out is not None:
                d_p_out, d_p_lse = partial_grads(dout, out, lse, p_out, p_lse)
        if torch.is_grad_enabled():  # create_graph=True: refuse a second derivative loudly
            dq, dk, dv = _NoSecondDerivative.apply(dq, dk, dv, dout, q, k, v)
        return None, dq, dk, dv, None, None, dsinks, d_p_out, d_p_lse


def run_ring(
    q, k, v, cfg: PreparedRing, placement: RankPlacement | None = None, sinks=None, partial=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A validated call (see :func:`ring_attention`): (out, lse), differentiable in q/k/v.
    ``placement``: in a compiled graph, the live packing's (its piece boundaries and
    longest document reach the kernels as a tensor and a symbolic size, see
    :func:`usp.ring.p2p._plan`), since ``cfg`` is then the trace's constant, shared by
    every packing of the call's shape; None: ``cfg``'s own. ``sinks``: [h] logits of
    this rank's query heads (:mod:`usp.ring.sinks`), or None. ``partial``: (out [B, L, h,
    D], lse [B, h, L]) of more keys per row, computed elsewhere and merged in
    (:mod:`usp.ring.partial`), or None."""
    p_out, p_lse = (None, None) if partial is None else partial
    if placement is None:
        return _RingAttention.apply(cfg, q, k, v, None, None, sinks, p_out, p_lse)
    # .size(0), not .shape[0]: Dynamo (torch 2.13) fails on .shape of a tensor held by a
    # constant of the trace (the HF plug-in's placement is one)
    longest = placement.longest.size(0)
    cu = placement.piece_docs.cu_q
    return _RingAttention.apply(cfg, q, k, v, cu, longest, sinks, p_out, p_lse)


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
    verify: bool | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """Attention over the whole sequence held, sharded, by the ranks of ``group``.

    q [B, L, H, D], k/v [B, L, Hkv, D]: this rank's L = S / r tokens in ``layout``
    (see :mod:`usp.ring.layout`; use :func:`usp.shard_sequence` to place them).
    Returns out [B, L, H, D] (and lse [B, H, L] in float32 when ``return_lse``).
    ``cu_seqlens`` (int32 [N+1], identical on every rank) are the document boundaries
    of the *global* packed sequence (batch 1): attention is then block-diagonal by
    document, each document placed as :mod:`usp.ring.documents` describes.
    Only the Hkv K/V heads travel. ``kv_head_chunks`` (a divisor of Hkv): attend to
    that many groups of KV heads one after the other, so that the ring's buffers (the
    all-gather's gathered K/V; the p2p ring's float32 accumulators and K/V messages)
    exist for one group at a time (:mod:`usp.ring.heads`); the result is the same.
    Everything is validated before anything is sent;
    ``verify`` (default: on for gloo groups) also makes the ranks agree on the call
    first, so a bad input on any rank raises the same error on every rank.
    Second derivatives are not supported (a clear error if attempted).
    """
    bounds = None

    def validate() -> PreparedRing:
        nonlocal bounds
        check_choice("sequence layout", layout, LAYOUTS, RingInputError)
        check_choice("ring_impl", ring_impl, RING_IMPLS, RingInputError)
        check_choice("attention backend", backend, BACKENDS, RingInputError)
        spec = validate_inputs(q, k, v, causal=causal, window=None)
        size = dist.get_world_size(group)
        if cu_seqlens is not None:
            bounds = _packed_bounds(cu_seqlens, q, size)
        placement = ring_placement(
            spec, group, layout, ring_impl, None if bounds is None else tuple(bounds)
        )
        return prepare_ring(
            spec, group, placement, causal=causal, softmax_scale=softmax_scale, layout=layout,
            ring_impl=ring_impl, backend=backend, comm_stats=comm_stats,
            kv_head_chunks=kv_head_chunks,
        )  # fmt: skip

    def fields():
        options = {"layout": (layout, LAYOUTS), "ring_impl": (ring_impl, RING_IMPLS)}
        options["backend"] = (backend, BACKENDS)
        chunks = kv_head_chunks if type(kv_head_chunks) is int else -1
        return call_fields(
            q, k, v, causal=causal, softmax_scale=softmax_scale, options=options,
            documents=documents_field(bounds), grad=grad_field(grad_mask(q, k, v), "qkv"),
        ) + [Field("kv_head_chunks", chunks)]  # fmt: skip

    cfg = checked_call(group, "ring_attention", fields, validate, RING_ERRORS, verify)
    out, lse = run_ring(q, k, v, cfg)
    return (out, lse) if return_lse else out


RING_ERRORS = (RingInputError, BackendUnavailableError, AttentionInputError, DocumentLayoutError)


def _packed_bounds(cu_seqlens, q, ring_size: int) -> list[int]:
    if q.shape[0] != 1:
        raise RingInputError(f"packed sequences (cu_seqlens) need batch size 1, got {q.shape[0]}")
    total = q.shape[1] * ring_size
    try:
        return validate_cu_seqlens(cu_seqlens, total, "cu_seqlens")
    except ValueError as err:
        raise RingInputError(f"{err} (the global packed sequence has {total} tokens)") from None


def ring_placement(spec, group, layout, ring_impl, bounds) -> RankPlacement:
    """This rank's placement: dense (cached per shape) or packed (``bounds`` given)."""
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    allgather = ring_impl == "allgather"
    if bounds is None:
        multiple = required_local_multiple(layout, spec.causal)
        if spec.seqlen_q % multiple:
            raise RingInputError(
                f"the {layout} layout needs the local sequence length to be a multiple of "
                f"{multiple} (global length a multiple of {multiple * size} on a ring of "
                f"{size}), got {spec.seqlen_q}"
            )
        if size == 1:  # one rank: nothing to index (and nothing cached, for torch.compile)
            return single_rank_placement(spec.seqlen_q, spec.device)
        return dense_placement(
            spec.seqlen_q * size, size, layout, spec.causal, rank, spec.device, allgather
        )
    documents = Documents.from_bounds(list(bounds), size, layout)
    return packed_placement(documents, rank, spec.device, allgather=allgather)


def prepare_ring(
    spec: AttentionSpec,
    group,
    placement: RankPlacement,
    *,
    causal: bool,
    softmax_scale,
    layout: str,
    ring_impl: str,
    backend: str,
    comm_stats: CommStats | None,
    kv_head_chunks: int = 1,
    window: int | None = None,
    kernel_registry: KernelRegistry | None = None,
    kv_dims: KVDims | None = None,
) -> PreparedRing:
    """Every local check of a ring call, so that nothing fails after the first send: the
    group's device, lengths, head chunks, softmax scale and the kernel backend (looked
    up in ``kernel_registry``, default usp's). ``kv_dims``: K's and V's own head sizes
    inside pairs padded to one (MLA), so that messages carry only those columns."""
    if spec.seqlen_q != spec.seqlen_k:
        raise RingInputError(
            "ring attention needs q and k/v with the same local sequence length, "
            f"got {spec.seqlen_q} and {spec.seqlen_k}"
        )
    if placement.documents.local_len != spec.seqlen_q:
        raise RingInputError(
            f"the documents place {placement.documents.local_len} tokens on each ring rank, "
            f"but q holds {spec.seqlen_q}"
        )
    if group is not None:
        _check_device(group, spec.device)
    if isinstance(kv_head_chunks, bool) or not isinstance(kv_head_chunks, int):
        raise RingInputError(f"kv_head_chunks must be an integer >= 1, got {kv_head_chunks!r}")
    try:
        head_chunks(spec.num_kv_heads, kv_head_chunks)
    except ValueError as err:
        raise RingInputError(str(err)) from None
    scale = default_scale(spec.head_dim, softmax_scale)
    kernels = BlockKernels(spec, backend, scale, kernel_registry)
    size = 1 if group is None else dist.get_world_size(group)
    peers = TracedGroup.of(group) if size > 1 else None
    cfg = PreparedRing(
        group, causal, layout, ring_impl, kernels, placement, comm_stats, kv_head_chunks, peers,
        window, kv_dims,
    )  # fmt: skip
    # the largest local kernel call first (the same on every rank, so a backend that
    # cannot run it fails alike everywhere), then every block shape this ring runs
    widest = spec.seqlen_k * (size if ring_impl == "allgather" else 1)
    first = (
        spec.seqlen_q, widest, spec.num_heads, spec.num_kv_heads, causal, placement.packed, window
    )  # fmt: skip
    kernels.resolve(*first)
    for shape in sorted(_block_shapes(cfg, spec), key=_shape_order):
        kernels.resolve(*shape)
    return cfg


def _shape_order(shape: tuple) -> tuple:
    """A block shape as a sort key the same on every rank (a window may be None)."""
    return (*shape[:-1], -1 if shape[-1] is None else shape[-1])


def _block_shapes(cfg: PreparedRing, spec: AttentionSpec) -> set[tuple]:
    """(Sq, Sk, H, Hkv, causal, varlen) of every kernel call the ring of
    :func:`_implementation` makes on this rank."""
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if cfg.ring_impl == "allgather" and cfg.size > 1:
        return allgather_block_shapes(cfg, spec.seqlen_q, heads, kv_heads)
    chunks = cfg.kv_head_chunks  # the local and p2p passes run per group of KV heads
    return p2p_block_shapes(cfg, spec.seqlen_q, heads // chunks, kv_heads // chunks)


def _check_device(group, device: torch.device) -> None:
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        raise RingInputError(
            f"the ring group uses NCCL, which needs CUDA tensors; got tensors on {device}"
        )
    if backend == "gloo" and device.type != "cpu":
        raise RingInputError(
            f"the ring group uses gloo; pass CPU tensors (got {device}) or use an NCCL group"
        )

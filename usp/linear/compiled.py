"""A Gated DeltaNet layer's ring block as one ``torch.library`` op, for ``torch.compile``.

Eagerly, :func:`usp.linear.block.ring_block` lays a rank's block out as a padded batch of
segments (one chunk of one document each), sized by the packing's host ints: the number
of segments, the longest one, and the chunked kernel's loop over its chunks. A graph
that traced them would hold one packing's sizes as constants (every new packing
recompiles, and the longest segment's ``max`` fails as a symbolic size). So under
compilation the whole block is one opaque op with a fixed output shape:

    usp::gdn_ring_block(q, k, v, g, beta, conv_weights, bounds, ...) -> [B, S/r, h, dv]

``bounds`` are the packing's global document boundaries as a tensor (int, on the CPU:
read on the host inside the op, for free; ``Plan.pack`` marks its size dynamic, so one
graph serves every document count), or None for a dense sequence. The rest are plain
values fixed per model and plan: the global length, layout, degrees, the ring group's
name (``ring_block``'s two all-gathers run eagerly inside the op, on that group) and the
kernels' names (chosen and self-checked while the graph was traced).

Why an op and not a traced block: the segments' layout is what keeps the chunked
recurrence exact and cheap (no work on padding beyond the longest segment, the ring's
state maps one per segment); rebuilding it from device masks inside fixed-size chunks
would change every kernel (fla's included) for the same numbers. The op runs the eager
code itself, so compiled and eager results are the same computation.

Backward: ``usp::gdn_ring_block_backward`` recomputes the block under autograd on the
saved inputs and differentiates it (as :mod:`usp.models.moe_op` does for the experts):
the block's forward, and its two all-gathers, run once more per backward -- the cost of
an activation checkpoint of the block, in exchange for keeping none of its activations.
Eager runs never call the op.

Byte counters (``plan.comm_stats``) do not see the op's all-gathers, as they do not see a
compiled graph's functional collectives (:mod:`usp.comm.traced`).
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from usp.kernels.recompute import autograd_dispatch
from usp.linear.backends import DEFAULT as GDN_DEFAULT
from usp.linear.block import BlockOptions, RingPeers, ring_block
from usp.linear.conv import DEFAULT as CONV_DEFAULT
from usp.sp.sharding import sequence_documents

__all__ = ["gdn_ring_block"]

Tensor = torch.Tensor


def _run(q, k, v, g, beta, conv_weights, bounds, seq_len, layout, ring_group, ring_rank,
         ring_size, ulysses, activation, scale, use_qk_l2norm, chunk_size, kernel,
         conv_kernel) -> Tensor:  # fmt: skip
    """:func:`ring_block` from the op's arguments (host work: the documents' layout)."""
    cu = None if bounds is None else bounds.to("cpu", torch.int32)
    documents = sequence_documents(seq_len, ring_size, ulysses, layout, cu)
    group = None if ring_size == 1 else _resolve_process_group(ring_group)
    options = BlockOptions(
        activation, scale, use_qk_l2norm, chunk_size, GDN_DEFAULT.get(kernel),
        CONV_DEFAULT[conv_kernel] if conv_weights else None,
    )  # fmt: skip
    ws = list(conv_weights) if conv_weights else None
    out = ring_block([q, k, v, g, beta], documents, RingPeers(group, None, ring_rank), ws, options)
    return out.contiguous()


@torch.library.custom_op("usp::gdn_ring_block", mutates_args=())
def gdn_ring_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    conv_weights: list[Tensor],
    bounds: Tensor | None,
    seq_len: int,
    layout: str,
    ring_group: str,
    ring_rank: int,
    ring_size: int,
    ulysses: int,
    activation: str | None,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
    kernel: str,
    conv_kernel: str,
) -> Tensor:
    """See the module docstring (``conv_weights`` empty: no conv)."""
    return _run(q, k, v, g, beta, conv_weights, bounds, seq_len, layout, ring_group, ring_rank,
                ring_size, ulysses, activation, scale, use_qk_l2norm, chunk_size, kernel,
                conv_kernel)  # fmt: skip


@gdn_ring_block.register_fake
def _gdn_ring_block_fake(q, k, v, *args):
    return torch.empty_like(v, memory_format=torch.contiguous_format)


@torch.library.custom_op("usp::gdn_ring_block_backward", mutates_args=())
def gdn_ring_block_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    conv_weights: list[Tensor],
    bounds: Tensor | None,
    seq_len: int,
    layout: str,
    ring_group: str,
    ring_rank: int,
    ring_size: int,
    ulysses: int,
    activation: str | None,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
    kernel: str,
    conv_kernel: str,
) -> list[Tensor]:
    """The gradients of q, k, v, g, beta and every conv weight for the output's ``grad``,
    from the block recomputed under autograd (its all-gathers' backward: reduce-scatters,
    on every ring rank alike)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta, *conv_weights)]
    with autograd_dispatch(), torch.enable_grad():
        out = _run(*leaves[:5], leaves[5:], bounds, seq_len, layout, ring_group, ring_rank,
                   ring_size, ulysses, activation, scale, use_qk_l2norm, chunk_size, kernel,
                   conv_kernel)  # fmt: skip
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    out, seen = [], {grad.untyped_storage().data_ptr()}
    for d, t in zip(grads, leaves):
        if d is None:  # the output does not depend on it
            d = torch.zeros_like(t)
        elif d._is_view() or d.untyped_storage().data_ptr() in seen:
            d = d.clone()  # an op's outputs may not alias its inputs or each other
        seen.add(d.untyped_storage().data_ptr())
        out.append(d)
    return out


@gdn_ring_block_backward.register_fake
def _gdn_ring_block_backward_fake(grad, q, k, v, g, beta, conv_weights, *args):
    return [torch.empty_like(t) for t in (q, k, v, g, beta, *conv_weights)]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, conv_weights, bounds, *settings = inputs
    ctx.save_for_backward(q, k, v, g, beta, *conv_weights)
    ctx.bounds = bounds  # an int tensor on the CPU (no gradient)
    ctx.count = len(conv_weights)
    ctx.settings = settings


def _backward(ctx, grad):
    q, k, v, g, beta, *ws = ctx.saved_tensors
    grads = gdn_ring_block_backward(
        grad.contiguous(), q, k, v, g, beta, ws, ctx.bounds, *ctx.settings
    )
    settings = [None] * len(ctx.settings)
    # (an empty list input takes an empty list as its gradient)
    return (*grads[:5], grads[5:] if ctx.count else [], None, *settings)


gdn_ring_block.register_autograd(_backward, setup_context=_setup_context)

"""All-to-all of several tensors at once: split one dim over the group, gather another.

    all_to_all(tensors, AllToAllPlan(group, scatter_dim=a, gather_dim=b)):
        x [.., n_a, .., m_b, ..] on each of g ranks -> [.., n_a/g, .., g*m_b, ..]

Several tensors (e.g. q, k and v, with different head counts but one dtype) move in one
collective: each rank packs, for every destination, the pieces of all tensors into one
buffer. :func:`differentiable_all_to_all` is an autograd function whose backward is the
inverse all-to-all (itself differentiable, so second derivatives through it are exact).
What the dims mean (sequence, heads) is the caller's business (see :mod:`usp.sp.ulysses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from usp.comm import traced
from usp.comm.collectives import all_to_all_into
from usp.comm.stats import CommStats
from usp.comm.traced import TracedGroup


@dataclass(frozen=True)
class AllToAllPlan:
    """Split ``scatter_dim`` of every tensor over the group; concatenate ``gather_dim``."""

    group: dist.ProcessGroup
    scatter_dim: int
    gather_dim: int
    stats: CommStats | None = None

    def inverse(self) -> AllToAllPlan:
        return replace(self, scatter_dim=self.gather_dim, gather_dim=self.scatter_dim)


def _pieces(tensors: Sequence[torch.Tensor], scatter_dim: int, size: int) -> list[list[int]]:
    """The shape of the piece each tensor sends to one rank."""
    pieces = []
    for x in tensors:
        if x.shape[scatter_dim] % size:
            raise ValueError(
                f"all-to-all over {size} ranks needs dim {scatter_dim} of every tensor to be "
                f"a multiple of {size}, got shape {tuple(x.shape)}"
            )
        shape = list(x.shape)
        shape[scatter_dim] //= size
        pieces.append(shape)
    return pieces


def _by_destination(x: torch.Tensor, scatter_dim: int, size: int) -> torch.Tensor:
    """[.., n, ..] -> [size, .., n/size, ..] (a view): chunk j of scatter_dim goes to rank j."""
    return x.unflatten(scatter_dim, (size, x.shape[scatter_dim] // size)).movedim(scatter_dim, 0)


def _unpack(received: torch.Tensor, pieces, gather_dim: int) -> list[torch.Tensor]:
    """[size, sum of numels] (source rank first) -> each tensor [.., size * m, ..]."""
    outputs, offset = [], 0
    size = received.shape[0]
    for piece in pieces:
        numel = torch.Size(piece).numel()
        from_ranks = received[:, offset : offset + numel].view(size, *piece)
        outputs.append(from_ranks.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1))
        offset += numel
    return outputs


def all_to_all(tensors: Sequence[torch.Tensor], plan: AllToAllPlan) -> list[torch.Tensor]:
    """The collective itself (no autograd). Every tensor's ``scatter_dim`` must divide."""
    size = dist.get_world_size(plan.group)
    if size == 1:
        return list(tensors)
    pieces = _pieces(tensors, plan.scatter_dim, size)
    numels = [torch.Size(p).numel() for p in pieces]
    send = torch.empty((size, sum(numels)), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for x, piece, numel in zip(tensors, pieces, numels):
        chunks = _by_destination(x, plan.scatter_dim, size)
        send[:, offset : offset + numel].view(size, *piece).copy_(chunks)
        offset += numel
    received = all_to_all_into(torch.empty_like(send), send, plan.group, plan.stats)
    return _unpack(received, pieces, plan.gather_dim)


def traced_all_to_all(
    tensors: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int, group: TracedGroup
) -> list[torch.Tensor]:
    """:func:`differentiable_all_to_all` inside a compiled graph: the same packing, as
    ops autograd differentiates, around one functional all-to-all (whose autograd is the
    inverse all-to-all)."""
    if group.size == 1:
        return list(tensors)
    pieces = _pieces(tensors, scatter_dim, group.size)
    send = torch.cat(
        [_by_destination(x, scatter_dim, group.size).reshape(group.size, -1) for x in tensors],
        dim=1,
    )  # [size, sum of numels]
    received = traced.all_to_all(send, group.name, group.size)
    return _unpack(received, pieces, gather_dim)


class _AllToAllFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: AllToAllPlan, *tensors: torch.Tensor):
        ctx.plan = plan
        ctx.shapes = [t.shape for t in tensors]
        return tuple(t.contiguous() for t in all_to_all(tensors, plan))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        plan = ctx.plan
        size = dist.get_world_size(plan.group)
        filled = []
        for grad, shape in zip(grads, ctx.shapes):
            if grad is None:  # an output nobody used: its gradient is zero
                out_shape = list(shape)
                out_shape[plan.scatter_dim] //= size
                out_shape[plan.gather_dim] *= size
                grad = torch.zeros(out_shape, dtype=_dtype_of(grads), device=_device_of(grads))
            filled.append(grad)
        # through the autograd function again, so that a double backward is exact
        return (None, *_AllToAllFunction.apply(plan.inverse(), *filled))


def _dtype_of(grads):
    return next(g.dtype for g in grads if g is not None)


def _device_of(grads):
    return next(g.device for g in grads if g is not None)


def differentiable_all_to_all(
    tensors: Sequence[torch.Tensor], plan: AllToAllPlan
) -> list[torch.Tensor]:
    """:func:`all_to_all` with autograd (the backward is the inverse all-to-all)."""
    return list(_AllToAllFunction.apply(plan, *tensors))

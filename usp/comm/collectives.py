"""Counted wrappers of the collectives ``usp`` uses (all on gloo and NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from usp.comm.stats import CommStats


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch 2.13 renamed the tensor forms (the old names warn); older releases lack the new ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_uncounted(output: torch.Tensor, local: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 for bookkeeping (shape checks): not counted as traffic."""
    _all_gather_single(output, local.contiguous(), group=group)
    return output


def all_gather_into(
    output: torch.Tensor, local: torch.Tensor, group, stats: CommStats | None
) -> torch.Tensor:
    """``output`` [n * local.shape[0], ...] <- every rank's ``local``, in group-rank order."""
    size = dist.get_world_size(group)
    _all_gather_single(output, local.contiguous(), group=group)
    if stats is not None:
        stats.record(
            "all_gather", sent=(size - 1) * _bytes(local), received=(size - 1) * _bytes(local)
        )
    return output


def reduce_scatter_into(
    output: torch.Tensor, full: torch.Tensor, group, stats: CommStats | None
) -> torch.Tensor:
    """``output`` <- the sum over ranks of this rank's slice of ``full`` (dim 0 split)."""
    size = dist.get_world_size(group)
    _reduce_scatter_single(output, full.contiguous(), op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        moved = (size - 1) * _bytes(output)
        stats.record("reduce_scatter", sent=moved, received=moved)
    return output


def all_to_all_into(
    output: torch.Tensor, send: torch.Tensor, group, stats: CommStats | None
) -> torch.Tensor:
    """Equal-split all-to-all along dim 0: chunk j of ``send`` goes to rank j."""
    size = dist.get_world_size(group)
    dist.all_to_all_single(output, send, group=group)
    if stats is not None:
        moved = _bytes(send) * (size - 1) // size  # the chunk a rank keeps is not counted
        stats.record("all_to_all", sent=moved, received=moved)
    return output

"""Ulysses sequence parallelism: all-to-all sequence<->heads around local attention.

GQA head handling: the u ranks of a Ulysses group each take H/u query heads and must
hold the KV heads those query heads use. When u does not divide Hkv, every KV head is
repeated ``lcm(Hkv, u) / Hkv`` times before the all-to-all (see
:func:`usp.process_groups.kv_replication`); autograd sums the replicas' gradients.
"""

from __future__ import annotations

import torch

from usp.comm.all_to_all import AllToAllPlan, differentiable_all_to_all, traced_all_to_all
from usp.comm.stats import CommStats
from usp.comm.traced import TracedGroup
from usp.process_groups import HeadLayoutError, degrees


class UlyssesHeadError(HeadLayoutError):
    """The head counts cannot be split over the Ulysses degree; the message lists the
    (ulysses, ring) pairs that work for this sequence-parallel size."""


def kv_replication_for(
    num_heads: int,
    num_kv_heads: int,
    ulysses_degree: int,
    sp_degree: int,
    ranks_per_node: int | None = None,
) -> int:
    """``kv_replication`` with an error message that lists the valid degree pairs."""
    return degrees.kv_replication_for(
        num_heads, num_kv_heads, ulysses_degree, sp_degree, ranks_per_node, error=UlyssesHeadError
    )


def replicate_kv_heads(
    k: torch.Tensor, v: torch.Tensor, times: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, Hkv, D] -> [B, S, Hkv * times, D]: head e of the result is head e // times."""
    if times == 1:
        return k, v
    return k.repeat_interleave(times, dim=2), v.repeat_interleave(times, dim=2)


# Attention tensors are [B, S, H, D] (the flash-attn convention).
SEQ_DIM, HEAD_DIM = 1, 2


def _all_to_all(tensors, group, stats, scatter_dim: int, gather_dim: int):
    if isinstance(group, TracedGroup):  # inside a compiled graph
        return traced_all_to_all(tensors, scatter_dim, gather_dim, group)
    plan = AllToAllPlan(group, scatter_dim=scatter_dim, gather_dim=gather_dim, stats=stats)
    return differentiable_all_to_all(tensors, plan)


def to_head_sharded(
    tensors: list[torch.Tensor], group, stats: CommStats | None = None
) -> list[torch.Tensor]:
    """Sequence-sharded -> head-sharded, all tensors in one all-to-all (differentiable):
    [B, S/u, h, D] each -> [B, S, h/u, D] each (the group's whole sequence, h/u heads).
    ``group``: the Ulysses process group, or its :class:`~usp.comm.traced.TracedGroup`
    inside a compiled graph (a functional collective, not counted in ``stats``)."""
    return _all_to_all(tensors, group, stats, scatter_dim=HEAD_DIM, gather_dim=SEQ_DIM)


def to_sequence_sharded(out: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Head-sharded -> sequence-sharded (differentiable): [B, S, H/u, D] -> [B, S/u, H, D]."""
    return _all_to_all([out], group, stats, scatter_dim=SEQ_DIM, gather_dim=HEAD_DIM)[0]

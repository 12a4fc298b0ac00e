"""Placing a global sequence on sequence-parallel ranks, and gathering it back.

The layout (what ``usp_attention`` and ``ring_attention`` expect), for a global sequence
of S tokens, ring size r, Ulysses size u:
  1. ring level: ``contiguous`` gives ring rank i the i-th of r chunks; ``zigzag`` cuts
     the sequence into 2r chunks and gives ring rank i chunks i and 2r-1-i (in that order);
  2. Ulysses level: the ring rank's block of S/r tokens is cut into u contiguous pieces,
     and Ulysses rank j holds piece j.
After the Ulysses all-to-all, each rank of a Ulysses group holds the whole block of its
ring rank, which is the ring layout. Tokens, labels and position ids must all be
sharded this way (RoPE needs the global positions).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_uncounted

SEQUENCE_LAYOUTS = ("zigzag", "contiguous")


class ShardingError(ValueError):
    """A sequence cannot be placed on the ranks as asked."""


def required_multiple(ring_size: int, ulysses_size: int, layout: str) -> int:
    """The global sequence length must be a multiple of this."""
    _check_layout(layout)
    if layout == "zigzag":
        return ring_size * math.lcm(2, ulysses_size)  # 2r chunks, and u | S/r
    return ring_size * ulysses_size


def check_sequence_length(seq_len: int, ring_size: int, ulysses_size: int, layout: str) -> None:
    multiple = required_multiple(ring_size, ulysses_size, layout)
    if seq_len % multiple:
        padded = -(-seq_len // multiple) * multiple
        raise ShardingError(
            f"sequence length {seq_len} must be a multiple of {multiple} for the {layout} layout "
            f"with ring={ring_size}, ulysses={ulysses_size} (pad to {padded}, e.g. with usp.pad_to_multiple)"
        )


def sequence_positions(
    seq_len: int,
    *,
    ring_size: int,
    ring_rank: int,
    ulysses_size: int = 1,
    ulysses_rank: int = 0,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions (int64, in local order) held by rank (ring_rank, ulysses_rank)."""
    check_sequence_length(seq_len, ring_size, ulysses_size, layout)
    block = seq_len // ring_size
    if layout == "zigzag":
        half = block // 2
        first = torch.arange(ring_rank * half, (ring_rank + 1) * half, device=device)
        last_chunk = 2 * ring_size - 1 - ring_rank
        second = torch.arange(last_chunk * half, (last_chunk + 1) * half, device=device)
        ring_block = torch.cat([first, second])
    else:
        ring_block = torch.arange(ring_rank * block, (ring_rank + 1) * block, device=device)
    piece = block // ulysses_size
    return ring_block[ulysses_rank * piece : (ulysses_rank + 1) * piece]


def _check_layout(layout: str) -> None:
    if layout not in SEQUENCE_LAYOUTS:
        raise ShardingError(f"unknown sequence layout {layout!r}; valid layouts: {', '.join(SEQUENCE_LAYOUTS)}")


def sequence_multiple(topology, layout: str = "zigzag") -> int:
    """What the global sequence length must be a multiple of on ``topology``."""
    return required_multiple(topology.ring_degree, topology.ulysses_degree, layout)


def local_positions(seq_len: int, topology, *, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions of the tokens this rank holds, in local order (int64)."""
    return sequence_positions(
        seq_len, ring_size=topology.ring_degree, ring_rank=topology.ring_rank,
        ulysses_size=topology.ulysses_degree, ulysses_rank=topology.ulysses_rank,
        layout=layout, device=device,
    )


def shard_sequence(x: torch.Tensor, topology, *, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of ``x`` (the full sequence, identical on every SP rank) along
    ``dim``, in the order ``usp_attention`` expects. Differentiable (an index_select)."""
    dim = dim % x.dim()
    positions = local_positions(x.shape[dim], topology, layout=layout, device=x.device)
    return x.index_select(dim, positions)


def gather_sequence(x_local: torch.Tensor, topology, *, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence, on every SP rank.

    A collective over ``topology.sp_group`` (all SP ranks must call it). The result does
    not carry gradients back to ``x_local``.
    """
    dim = dim % x_local.dim()
    sp_size = topology.sp_degree
    front = x_local.detach().movedim(dim, 0).contiguous()  # [L, ...]
    gathered = torch.empty((sp_size * front.shape[0],) + front.shape[1:], dtype=front.dtype, device=front.device)
    all_gather_uncounted(gathered, front, topology.sp_group)
    seq_len = sp_size * front.shape[0]
    full = torch.empty_like(gathered)
    for group_rank, piece in enumerate(gathered.chunk(sp_size)):
        # torch orders the sp group by global rank; find each piece's (ring, ulysses) place
        coords = topology.rank_map.coords_of(dist.get_global_rank(topology.sp_group, group_rank))
        positions = sequence_positions(
            seq_len, ring_size=topology.ring_degree, ring_rank=coords.ring,
            ulysses_size=topology.ulysses_degree, ulysses_rank=coords.ulysses,
            layout=layout, device=full.device,
        )
        full.index_copy_(0, positions, piece)
    return full.movedim(0, dim)


def pad_to_multiple(x: torch.Tensor, multiple: int, *, dim: int = 1, value=0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` to a multiple of ``multiple`` with ``value``.

    For a causal model pad tokens at the end are harmless (nothing before them attends
    to them); pad labels with the loss's ignore index (e.g. -100) so they carry no loss.
    """
    if multiple < 1:
        raise ShardingError(f"multiple must be >= 1, got {multiple}")
    dim = dim % x.dim()
    missing = -x.shape[dim] % multiple
    if missing == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = missing
    return torch.cat([x, torch.full(pad_shape, value, dtype=x.dtype, device=x.device)], dim=dim)

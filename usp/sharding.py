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

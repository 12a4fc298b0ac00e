"""What every linear mixer does around its ring block: the documents of a call, the
Ulysses all-to-all of tensors of several dtypes, and each rank's share of per-channel
parameters (conv weights and biases, per-head values) when heads or groups are split
over the Ulysses ranks.

Channels are head-major (channel ``h * D + i`` is head h, dim i) and a Ulysses rank j
holds the j-th 1/u of the heads. Key heads (Gated DeltaNet) and B/C groups (Mamba-2)
that u does not divide are repeated ``lcm(n, u) / n`` times first, as GQA's KV heads are
(:func:`usp.process_groups.degrees.kv_replication_for`); their channels are repeated the
same way (:func:`replicated_channels`).
"""

from __future__ import annotations

import torch

from usp.ring.documents import Documents
from usp.sp.packing import PackedSequence
from usp.sp.sharding import sequence_documents
from usp.sp.ulysses import to_head_sharded

__all__ = [
    "document_bounds", "documents_of", "hashed", "rank_channels", "replicated_channels",
    "to_head_sharded_by_dtype",
]  # fmt: skip


def documents_of(plan, seq_len: int, packed) -> Documents:
    """The documents of a global sequence of ``seq_len`` tokens placed as ``plan`` places
    them (``packed``: cu_seqlens, a PackedSequence or None; plan None: one process)."""
    if plan is None:
        if isinstance(packed, PackedSequence):
            packed = packed.cu_seqlens
        return sequence_documents(seq_len, 1, 1, "contiguous", packed)
    if isinstance(packed, PackedSequence) or packed is None:
        packed = plan.packed_sequence(packed, seq_len=seq_len)
        if packed is not None:
            return packed.documents
    return sequence_documents(seq_len, plan.ring_degree, plan.ulysses_degree, plan.layout, packed)


def document_bounds(documents: Documents | None) -> list[int] | None:
    """The boundaries (cu_seqlens) of ``documents``, for an agreement field that shows
    them (:func:`usp.comm.call_check.documents_field`); None for none."""
    if documents is None:
        return None
    bounds = [0]
    for length in documents.lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def hashed(value: int) -> str:
    """How an agreement field shows a hash (:mod:`usp.comm.agreement`)."""
    return f"hash {value & 0xFFFFFFFF:08x}"


def to_head_sharded_by_dtype(tensors, group, stats):
    """[B, S/P, h, D] -> [B, S/r, h/u, D] for each tensor: one all-to-all per dtype (the
    decay may be float32 next to bfloat16 activations: an all-to-all moves one dtype, and
    casting the decay would lose it)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(index)
    out = list(tensors)
    for indices in by_dtype.values():
        moved = to_head_sharded([tensors[i] for i in indices], group, stats)
        for i, t in zip(indices, moved):
            out[i] = t
    return out


def replicated_channels(parameters, heads: int, times: int) -> list[torch.Tensor]:
    """Each of ``parameters`` ([heads * D, ...]: head-major channels) with every head's
    channels repeated ``times`` times, as the heads are before the all-to-all."""
    if times == 1:
        return list(parameters)
    return [
        p.reshape(heads, -1, *p.shape[1:]).repeat_interleave(times, 0).reshape(-1, *p.shape[1:])
        for p in parameters
    ]


def rank_channels(parameters, u: int, rank: int) -> list[torch.Tensor]:
    """The channels (dim 0) of Ulysses rank ``rank``'s heads: the rank-th 1/u of each."""
    return [p[rank * (p.shape[0] // u) : (rank + 1) * (p.shape[0] // u)] for p in parameters]

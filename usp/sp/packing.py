"""A packed global sequence placed on one plan's ranks (:class:`PackedSequence`), and the
error of a plan used with inputs it cannot serve (:class:`PlanError`).

Both are re-exported by :mod:`usp.sp.plan` (``Plan.pack`` builds a PackedSequence) and by
``usp``; they live here so that the attention path (:mod:`usp.sp.attend`) can use them
without importing the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from usp.comm.agreement import Field, stable_hash
from usp.errors import InputError
from usp.ring.documents import Documents
from usp.ring.placement import RankPlacement
from usp.sp.sharding import document_position_ids


class PlanError(InputError):
    """A plan was built or used with options or inputs it cannot serve."""


def check_packed_fits(got: tuple[int, int, str], expected: tuple[int, int, str]) -> None:
    """A PackedSequence built for (ring, ulysses, layout) = ``got`` used with a plan of
    ``expected``: refused unless they are equal."""
    if got != expected:
        raise PlanError(
            f"this PackedSequence was built for (ring, ulysses, layout) = {got}, the plan "
            f"has {expected}; build it with this plan's pack()"
        )


@dataclass(frozen=True, eq=False)
class PackedSequence:
    """A packed global sequence (batch 1) placed on one plan's ranks; build it with
    :meth:`Plan.pack`, once per batch, and pass it wherever ``cu_seqlens`` is accepted.

    ``cu_seqlens`` are the global int32 boundaries (on the CPU); ``placement`` holds the
    device tensors this rank's ring kernels use.
    """

    cu_seqlens: torch.Tensor
    bounds: tuple[int, ...]
    documents: Documents
    ulysses_degree: int
    placement: RankPlacement
    #: this rank's tokens as indices into the global sequence, in local order (int64
    #: [S/P], CPU): made here so that a compiled forward reads a tensor, not the
    #: documents (one graph for every packing)
    token_indices: torch.Tensor
    #: equal on two ranks exactly when their boundaries are equal
    fingerprint: int = field(init=False)
    #: every token's position inside its document, global sequence (int64 [S])
    position_ids: torch.Tensor = field(init=False)
    #: the global length, the layout and the ring degree it was placed for: fields, not
    #: properties (a compiled graph's tracing reads only the fields of some objects)
    seq_len: int = field(init=False)
    layout: str = field(init=False)
    ring_degree: int = field(init=False)

    def __post_init__(self):
        # computed once here, not cached lazily (lazy caches take a lock torch.compile
        # cannot trace): equal on two ranks exactly when their boundaries are equal
        object.__setattr__(self, "fingerprint", stable_hash(self.bounds))
        # every token's position inside its document, for the global sequence (int64)
        object.__setattr__(self, "position_ids", document_position_ids(self.cu_seqlens))
        object.__setattr__(self, "seq_len", self.bounds[-1])
        object.__setattr__(self, "layout", self.documents.layout)
        object.__setattr__(self, "ring_degree", self.documents.ring_size)


def dtype_id(dtype: torch.dtype) -> int:
    return stable_hash(list(str(dtype).encode()))


_DTYPE_NAMES = {
    dtype_id(d): str(d)
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
}


def show_dtype_id(code: int) -> str:
    return _DTYPE_NAMES.get(code, "another dtype")


def batch_field(fingerprint: int) -> Field:
    """The agreement entry of a global batch's fingerprint (what the SP ranks shard)."""
    return Field(
        "the global batch they shard (every SP rank must be given the same tokens and labels: "
        "load batches by data-parallel rank, not by rank)",
        fingerprint,
        lambda value: f"batch with hash {value}",
    )

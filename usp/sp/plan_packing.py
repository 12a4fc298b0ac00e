"""The plan's packed documents: :meth:`Plan.pack` and the packings every call builds
from it (placed by sequence, or by document with ``placement="documents"``).

:class:`PlanPacking` is a part of :class:`usp.sp.plan.Plan` (its base class), kept apart
so that the plan's own module stays about what a plan is; it reads the plan's grid
(``ring_degree``, ``ulysses_degree``, ``layout``, ``placement``, ranks and ``sp_group``).
"""

from __future__ import annotations

import torch

from usp.comm.agreement import agree, can_agree
from usp.comm.call_check import documents_field
from usp.ring.documents import Documents
from usp.ring.placement import packed_placement
from usp.sp.packing import PackedSequence, PlanError, batch_field, check_packed_fits
from usp.sp.placed import PlacedSequence, build_placed, check_placed_fits, placement_field
from usp.sp.sharding import (
    ShardingError,
    check_boundary_tensor,
    rank_token_indices,
    sequence_documents,
)


class PlanPacking:
    """Packed documents on a :class:`~usp.sp.plan.Plan` (see the module doc)."""

    def pack(
        self,
        cu_seqlens: torch.Tensor,
        *,
        device=None,
        seq_len: int | None = None,
        agree_ranks: bool = True,
        batch_fingerprint: int | None = None,
    ) -> PackedSequence:
        """Validate the global document boundaries of a packed sequence (batch 1) once,
        and build what the kernels need on ``device`` (default: this rank's device).
        ``seq_len``: the global length the boundaries must end at (default: their end).

        A collective over the SP group when ``agree_ranks`` (every SP rank must call it):
        the ranks agree on the boundaries, so a mismatch raises the same error everywhere.
        ``batch_fingerprint``: a hash of the global batch these boundaries go with
        (:func:`usp.models.batch.batch_fingerprint`), agreed in the same exchange.
        Raises :class:`~usp.sp.sharding.ShardingError` for boundaries the layout cannot place
        (they say what to pad; see :func:`usp.pad_documents`).
        """
        error, packed = None, None
        try:
            packed = self._build_packed(cu_seqlens, device, seq_len)
        except ShardingError as err:
            error = err
        group = self.sp_group
        if agree_ranks and group is not None and self.sp_degree > 1 and can_agree(group):
            fields = [
                documents_field(None if packed is None else packed.bounds, "cu_seqlens"),
                placement_field(packed),  # which rank computes which document
            ]
            if batch_fingerprint is not None:
                fields.append(batch_field(batch_fingerprint))
            agree(group, "Plan.pack", fields, error, (ShardingError,))
        if error is not None:
            raise error
        return packed

    def _build_packed(self, cu_seqlens, device, seq_len) -> PackedSequence | PlacedSequence:
        check_boundary_tensor(cu_seqlens)
        if self.placement == "documents":
            return build_placed(self, cu_seqlens, device, seq_len)
        return self.build_sequence_packing(cu_seqlens, device, seq_len)

    def build_sequence_packing(self, cu_seqlens, device, seq_len) -> PackedSequence:
        """``cu_seqlens`` placed by sequence (every document split over the SP group), on
        this rank; no collective."""
        total = int(cu_seqlens[-1]) if seq_len is None else seq_len
        documents = sequence_documents(
            total, self.ring_degree, self.ulysses_degree, self.layout, cu_seqlens
        )
        bounds = tuple(cu_seqlens.tolist())
        placement = packed_placement(
            documents,
            self.ring_rank,
            self.default_device() if device is None else torch.device(device),
            allgather=self.ring_impl == "allgather",
        )
        cpu = cu_seqlens.detach().to("cpu", torch.int32)
        # a compiled graph that reads the boundaries (the GDN ring block's op) takes them
        # as a tensor of any length: one graph for every document count
        torch._dynamo.maybe_mark_dynamic(cpu, 0)
        indices = rank_token_indices(
            documents, self.ring_rank, self.ulysses_degree, self.ulysses_rank
        )
        return PackedSequence(cpu, bounds, documents, self.ulysses_degree, placement, indices)

    def packed_sequence(
        self, packed, *, device=None, seq_len: int | None = None
    ) -> PackedSequence | None:
        """``packed`` as a :class:`PackedSequence` of this plan: None stays None, a
        cu_seqlens tensor is packed here without a collective (the attention call's own
        agreement covers it), a PackedSequence is checked to fit this plan and, when
        ``seq_len`` is given, the global length of the tensors it goes with."""
        if packed is None:
            return None
        if isinstance(packed, PlacedSequence):
            check_placed_fits(self, packed, seq_len)
            return packed
        if isinstance(packed, PackedSequence):
            if self.placement == "documents":
                raise PlanError(
                    "this plan places documents (placement='documents'), but the "
                    "PackedSequence was packed by sequence; build it with this plan's pack()"
                )
            check_packed_fits(
                (packed.ring_degree, packed.ulysses_degree, packed.layout),
                (self.ring_degree, self.ulysses_degree, self.layout),
            )
            if seq_len is not None and packed.seq_len != seq_len:
                raise ShardingError(
                    f"the packed sequence has {packed.seq_len} tokens, but the tensors hold "
                    f"{seq_len} over the {self.sp_degree} SP rank(s)"
                )
            return packed
        return self.pack(packed, device=device, seq_len=seq_len, agree_ranks=False)

    def shard_packing(self, packed, local_len: int, *, device=None):
        """The packing of tensors of which this rank holds ``local_len`` tokens (what a
        forward or an attention call has): ``packed`` (cu_seqlens, packed here without a
        collective, or a PackedSequence / PlacedSequence of this plan) checked to give
        this rank that many tokens; None stays None."""
        if packed is None or self.placement == "sequence":
            return self.packed_sequence(packed, device=device, seq_len=local_len * self.sp_degree)
        placed = self.packed_sequence(packed, device=device)
        if placed.local_len != local_len:
            raise ShardingError(
                f"this rank holds {local_len} tokens, but placement='documents' gives SP rank "
                f"{placed.sp_rank} {placed.local_len} of these documents; shard every "
                "token-aligned tensor with plan.shard(x, packed=plan.pack(cu_seqlens))"
            )
        return placed

    def _placed(self, seq_len: int, packed) -> PlacedSequence | None:
        """placement="documents": ``packed`` as this plan's PlacedSequence (None: dense,
        or placed by sequence)."""
        if packed is None or self.placement == "sequence":
            return None
        return self.packed_sequence(packed, seq_len=seq_len)

    def _documents(self, seq_len: int, packed) -> Documents:
        if isinstance(packed, PackedSequence):
            return self.packed_sequence(packed, seq_len=seq_len).documents
        return sequence_documents(
            seq_len, self.ring_degree, self.ulysses_degree, self.layout, packed
        )

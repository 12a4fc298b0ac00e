"""A packed sequence placed by documents (``Plan(..., placement="documents")``): what one
SP rank holds, and how a token mixer computes over it.

The SP ranks agree on the boundaries and compute the same
:class:`~usp.sp.assignment.DocumentAssignment` from them. SP rank ``s`` (``ring_rank * u
+ ulysses_rank``) then holds, in this local order:

1. its share of the *split* documents: they form a packed sub-sequence of their own
   (the documents in order, ``S_split`` tokens), placed as ``"sequence"`` places a packed
   sequence (:mod:`usp.ring.documents`): ``m = S_split / P`` tokens on every rank;
2. its *whole* documents, each contiguous, in document order.

A token mixer (attention, Gated DeltaNet) runs the first ``m`` rows through the usual SP
path (all-to-all, ring, all-to-all, on equal shares: the all-to-alls need no splits)
and the rest through the one-process path (one varlen call over the rank's whole
documents, every head, no communication), and concatenates the two outputs in that
order (:func:`run_placed`). Token-local layers and the loss see the rank's tokens as
they are; positions and labels follow ``token_indices`` like any shard. Every rank
knows every rank's token count from the assignment, so nothing else is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from usp.comm.agreement import Field, agree, can_agree, stable_hash
from usp.comm.call_check import verify_by_default
from usp.comm.collectives import all_gather_uncounted
from usp.sp.assignment import DocumentAssignment, assign_documents
from usp.sp.attend import USP_ERRORS, attend, check_call
from usp.sp.packing import PackedSequence, PlanError
from usp.sp.sharding import (
    ShardingError,
    document_position_ids,
    rank_token_indices,
    validated_bounds,
)

__all__ = ["PlacedSequence", "attend_placed", "build_placed", "placed_packing", "run_placed"]


@dataclass(frozen=True, eq=False)
class PlacedSequence:
    """A packed global sequence (batch 1) placed by documents on one plan's ranks; build
    it with :meth:`usp.Plan.pack` on a plan with ``placement="documents"`` and pass it
    wherever a :class:`~usp.sp.packing.PackedSequence` is accepted (see the module
    docstring for the local order).

    ``split``: the split documents as a PackedSequence of the plan (None: none split);
    ``whole``: this rank's whole documents as a PackedSequence of the one-process plan
    (None: it holds none)."""

    cu_seqlens: torch.Tensor
    bounds: tuple[int, ...]
    assignment: DocumentAssignment
    sp_rank: int
    split: PackedSequence | None
    whole: PackedSequence | None
    #: this rank's tokens as indices into the global sequence, in local order (int64, CPU)
    token_indices: torch.Tensor
    ring_degree: int
    ulysses_degree: int
    layout: str
    #: equal on two ranks exactly when their boundaries and assignments are equal
    fingerprint: int = field(init=False)
    #: every token's position inside its document, global sequence (int64 [S])
    position_ids: torch.Tensor = field(init=False)
    seq_len: int = field(init=False)
    #: this rank's tokens of the split documents (the same on every rank), then in all
    split_len: int = field(init=False)
    local_len: int = field(init=False)
    placement: str = field(init=False, default="documents")

    def __post_init__(self):
        encoded = (*self.bounds, -2, *self.assignment.encoded())
        object.__setattr__(self, "fingerprint", stable_hash(encoded))
        object.__setattr__(self, "position_ids", document_position_ids(self.cu_seqlens))
        object.__setattr__(self, "seq_len", self.bounds[-1])
        object.__setattr__(
            self, "split_len", 0 if self.split is None else self.split.token_indices.numel()
        )
        object.__setattr__(self, "local_len", self.token_indices.numel())


def placement_field(packed) -> Field:
    """The agreement entry of where ``placement="documents"`` puts each document (0 for a
    sequence placed as usual): equal boundaries do not make equal assignments when the
    ranks balance by different cost models (``placement_cost``)."""
    value = packed.fingerprint if isinstance(packed, PlacedSequence) else 0
    return Field(
        "the documents' placement (placement='documents' must balance with the same "
        "placement_cost on every rank)",
        value,
        lambda v: "placed by sequence" if v == 0 else f"an assignment with hash {v}",
    )


def build_placed(plan, cu_seqlens, device, seq_len: int | None) -> PlacedSequence:
    """``cu_seqlens`` placed by documents on ``plan``'s ranks, for this rank (no
    collective: :meth:`usp.Plan.pack` agrees on the result's fingerprint)."""
    bounds = validated_bounds(cu_seqlens, seq_len)
    assignment = assign_documents(
        bounds, ring=plan.ring_degree, ulysses=plan.ulysses_degree, layout=plan.layout,
        multiple=plan.sequence_multiple, cost=plan.placement_cost,
    )  # fmt: skip
    device = plan.default_device() if device is None else torch.device(device)
    split = whole = None
    if assignment.split:
        sub = torch.tensor(split_sub_bounds(assignment), dtype=torch.int32)
        split = plan.build_sequence_packing(sub, device, None)
    sp_rank = plan.ring_rank * plan.ulysses_degree + plan.ulysses_rank
    if assignment.whole[sp_rank]:
        mine = torch.tensor(whole_bounds(assignment, sp_rank), dtype=torch.int32)
        whole = plan.whole_plan.build_sequence_packing(mine, device, None)
    indices = placed_token_indices(
        assignment, None if split is None else split.documents, plan.ring_rank,
        plan.ulysses_degree, plan.ulysses_rank,
    )  # fmt: skip
    return PlacedSequence(
        cu_seqlens.detach().to("cpu", torch.int32), tuple(bounds), assignment, sp_rank, split,
        whole, indices, plan.ring_degree, plan.ulysses_degree, plan.layout,
    )  # fmt: skip


def check_placed_fits(plan, placed: PlacedSequence, seq_len: int | None) -> None:
    """A PlacedSequence used with ``plan``: refused unless ``plan`` places documents on
    the same degrees, layout and rank (and, when given, ``seq_len`` is its length)."""
    if plan.placement != "documents":
        raise PlanError(
            "this PlacedSequence was packed by a plan with placement='documents'; the plan "
            "given places by sequence: build it with this plan's pack()"
        )
    got = (placed.ring_degree, placed.ulysses_degree, placed.layout, placed.sp_rank)
    sp_rank = plan.ring_rank * plan.ulysses_degree + plan.ulysses_rank
    expected = (plan.ring_degree, plan.ulysses_degree, plan.layout, sp_rank)
    if got != expected:
        raise PlanError(
            f"this PlacedSequence was built for (ring, ulysses, layout, sp_rank) = {got}, the "
            f"plan has {expected}; build it with this plan's pack()"
        )
    if seq_len is not None and placed.seq_len != seq_len:
        raise ShardingError(
            f"the packed sequence has {placed.seq_len} tokens, but the tensors hold {seq_len}; "
            "under placement='documents' the SP ranks hold different numbers of tokens, so "
            "a global length is not a rank's times the SP degree (plan.shard_packing(packed, "
            "local_len) checks a rank's share)"
        )


def split_sub_bounds(assignment: DocumentAssignment) -> list[int]:
    """Cumulative boundaries of the split documents as one packed sub-sequence."""
    bounds = [0]
    for d in assignment.split:
        bounds.append(bounds[-1] + assignment.lengths[d])
    return bounds


def whole_bounds(assignment: DocumentAssignment, rank: int) -> list[int]:
    """Cumulative boundaries of SP rank ``rank``'s whole documents, in local order."""
    bounds = [0]
    for d in assignment.whole[rank]:
        bounds.append(bounds[-1] + assignment.lengths[d])
    return bounds


def _ranges(assignment: DocumentAssignment, documents) -> torch.Tensor:
    """Global positions of ``documents``, concatenated in order (int64)."""
    parts = [
        torch.arange(assignment.starts[d], assignment.starts[d] + assignment.lengths[d])
        for d in documents
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def placed_token_indices(
    assignment: DocumentAssignment, split_documents, ring_rank: int, ulysses: int, ulysses_rank: int
) -> torch.Tensor:
    """Global indices of the tokens SP rank (``ring_rank``, ``ulysses_rank``) holds, in
    local order: its share of the split documents (``split_documents``: their
    :class:`~usp.ring.documents.Documents`, None when none is split), then its whole
    ones."""
    parts = []
    if split_documents is not None:
        split_positions = _ranges(assignment, assignment.split)  # sub-sequence -> global
        parts.append(
            split_positions[rank_token_indices(split_documents, ring_rank, ulysses, ulysses_rank)]
        )
    parts.append(_ranges(assignment, assignment.whole[ring_rank * ulysses + ulysses_rank]))
    return torch.cat(parts)


# ------------------------------------------------------------------ token mixers
def attend_placed(
    plan, q, k, v, *, causal, softmax_scale, packed, verify, head_chunks, window, sinks
) -> torch.Tensor:
    """:meth:`usp.Plan.attention` of a plan that places documents: the split documents'
    rows through the SP path, the whole ones' through one local varlen call."""
    if torch.compiler.is_compiling():
        raise PlanError(
            "placement='documents' runs eagerly: compile a plan that places by sequence, "
            "or call the model without torch.compile"
        )
    placed, error = shard_packing_or_error(plan, packed, q.shape[1], q.device, USP_ERRORS)

    def call(part_plan, parts, part):
        return attend(
            part_plan, *parts, causal=causal, softmax_scale=softmax_scale, packed=part,
            verify=verify if part_plan is plan.split_plan else False, head_chunks=head_chunks,
            window=window, sinks=sinks,
        )  # fmt: skip

    def check_whole(parts):
        check_call(
            plan.whole_plan, *parts, causal, softmax_scale, placed.whole, head_chunks, sinks,
            window,
        )  # fmt: skip

    return run_placed(
        plan, placed, [q, k, v], call, what="usp_attention (placed documents)",
        check_whole=check_whole, errors=USP_ERRORS, verify=verify, error=error,
    )  # fmt: skip


def shard_packing_or_error(plan, packed, local_len: int, device, errors):
    """``plan.shard_packing(packed, local_len)``, or (None, the error) for an error of
    ``errors`` (raised on every rank by :func:`run_placed` after the ranks agree)."""
    try:
        return plan.shard_packing(packed, local_len, device=device), None
    except tuple(errors) as err:
        return None, err


def placed_packing(plan, packed, local_len: int, device) -> PlacedSequence:
    """A forward's packing under ``placement="documents"``: ``packed`` (cu_seqlens, packed
    here with the SP ranks' agreement, or a PlacedSequence) checked to give this rank
    ``local_len`` tokens; with the plan's ``verify_calls`` (None: on for gloo) the ranks
    agree on that check, so tokens sharded for another placement on some rank are one
    error on every rank."""
    if not isinstance(packed, PlacedSequence):
        packed = plan.pack(packed, device=device)  # a collective: agreed boundaries
    placed, error = shard_packing_or_error(
        plan, packed, local_len, device, (ShardingError, PlanError)
    )
    group = plan.sp_group
    verify = verify_by_default(group) if plan.verify_calls is None else plan.verify_calls
    if verify and group is not None and plan.sp_degree > 1 and can_agree(group):
        agree(group, "the forward's placed documents", [Field("documents", packed.fingerprint)],
              error, (ShardingError, PlanError))  # fmt: skip
    if error is not None:
        raise error
    return placed


def run_placed(plan, placed, tensors, call, *, what: str, check_whole, errors, verify, error=None):
    """A token mixer over a placed sequence: ``call(plan, parts, packed)`` on the split
    rows (the plan placing by sequence, ``placed.split``) and on the whole documents' rows (the plan's
    one-process plan, ``placed.whole``), concatenated along the sequence dim (1).

    ``check_whole(whole_parts)``: validates the whole documents' call on this rank
    without running it; with ``verify`` (None: on for gloo) the SP ranks agree on its
    outcome and on ``error`` (this rank's tensors not fitting the placement: ``placed``
    None) first, so an input only some ranks cannot serve fails on every rank before the
    split call communicates."""
    group = plan.sp_group
    if verify is None:
        verify = verify_by_default(group)
    if error is None and placed.whole is not None:
        try:
            check_whole([None if t is None else t[:, placed.split_len :] for t in tensors])
        except tuple(errors) as err:  # shared below: raised on every rank
            error = err
    if verify and group is not None and plan.sp_degree > 1 and can_agree(group):
        fingerprint = 0 if placed is None else placed.fingerprint
        agree(group, what, [Field("documents", fingerprint)], error, errors)
    if error is not None:
        raise error
    m = placed.split_len
    split_parts = [None if t is None else t[:, :m] for t in tensors]
    whole_parts = [None if t is None else t[:, m:] for t in tensors]
    outputs = []
    if placed.split is not None:
        outputs.append(call(plan.split_plan, split_parts, placed.split))
    if placed.whole is not None:
        outputs.append(call(plan.whole_plan, whole_parts, placed.whole))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


# ------------------------------------------------------------------ gathering
def gather_placed(x_local: torch.Tensor, plan, placed: PlacedSequence, dim: int) -> torch.Tensor:
    """Every SP rank's part of ``x`` along ``dim`` put back in global order (a collective
    over the SP group; no gradient). Ranks hold different counts: each part is padded to
    the largest before one all-gather."""
    topology = plan.topology
    sp, u = topology.sp_degree, topology.ulysses_degree
    counts = [placed.assignment.rank_tokens(s) for s in range(sp)]
    longest = max(counts)
    front = x_local.detach().movedim(dim, 0)  # [n_rank, ...]
    padded = front.new_zeros((longest,) + front.shape[1:])
    padded[: front.shape[0]] = front
    gathered = front.new_empty((sp * longest,) + front.shape[1:])
    all_gather_uncounted(gathered, padded, topology.sp_group)
    split_documents = None if placed.split is None else placed.split.documents
    full = front.new_empty((placed.seq_len,) + front.shape[1:])
    for group_rank, piece in enumerate(gathered.chunk(sp)):
        coords = topology.rank_map.coords_of(dist.get_global_rank(topology.sp_group, group_rank))
        indices = placed_token_indices(
            placed.assignment, split_documents, coords.ring, u, coords.ulysses
        )
        full.index_copy_(
            0, indices.to(full.device), piece[: counts[coords.ring * u + coords.ulysses]]
        )
    return full.movedim(0, dim)

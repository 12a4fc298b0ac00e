"""Placing a global sequence on sequence-parallel ranks, and gathering it back.

The layout (what ``usp_attention`` and ``ring_attention`` expect), for a global sequence
of S tokens, ring size r, Ulysses size u:
  1. ring level: ``contiguous`` gives ring rank i the i-th of r chunks; ``zigzag`` cuts
     the sequence into 2r chunks and gives ring rank i chunks i and 2r-1-i (in that order).
     A packed sequence (``cu_seqlens``) is placed document by document: every document
     is cut into 2r (or r) chunks, and ring rank i holds chunk i of every document, then
     chunk 2r-1-i of every document (see :mod:`usp.ring.documents`);
  2. Ulysses level: the ring rank's block of S/r tokens is cut into u contiguous pieces,
     and Ulysses rank j holds piece j.
After the Ulysses all-to-all, each rank of a Ulysses group holds the whole block of its
ring rank, which is the ring layout. Tokens, labels and position ids must all be
sharded this way (RoPE needs the global positions, or the in-document positions of
:func:`document_position_ids` for packed sequences).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_uncounted
from usp.errors import ShardingError  # noqa: F401 - re-exported here
from usp.kernels.spec import validate_cu_seqlens
from usp.options import LAYOUTS, check_choice, layout_chunks
from usp.ring.documents import Documents
from usp.sp.assignment import split_padding


def required_multiple(ring_size: int, ulysses_size: int, layout: str) -> int:
    """The global length of a dense sequence must be a multiple of this."""
    _check_layout(layout)
    # whole chunks, and u | S/r
    return math.lcm(layout_chunks(layout, ring_size), ring_size * ulysses_size)


def check_sequence_length(seq_len: int, ring_size: int, ulysses_size: int, layout: str) -> None:
    multiple = required_multiple(ring_size, ulysses_size, layout)
    if seq_len % multiple:
        padded = -(-seq_len // multiple) * multiple
        raise ShardingError(
            f"sequence length {seq_len} must be a multiple of {multiple} for the {layout} layout "
            f"with ring={ring_size}, ulysses={ulysses_size} (pad to {padded}, e.g. with usp.pad_to_multiple)"
        )


def check_boundary_tensor(cu_seqlens) -> None:
    """The shape and device checks that come before reading boundaries' values."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ShardingError(f"cu_seqlens must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.device.type == "meta":
        raise ShardingError("cu_seqlens is on the meta device; pass real boundaries (CPU)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ShardingError(
            "cu_seqlens must be a 1-D int32 tensor [0, ..., total] with at least 2 entries, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )


def _bounds(cu_seqlens, seq_len: int | None = None) -> list[int]:
    """Validated boundaries (ending at ``seq_len``, or wherever they end)."""
    check_boundary_tensor(cu_seqlens)
    if seq_len is None:
        seq_len = int(cu_seqlens[-1])
    try:
        return validate_cu_seqlens(cu_seqlens, seq_len, "cu_seqlens")
    except ValueError as err:
        raise ShardingError(str(err)) from None


def validated_bounds(cu_seqlens, seq_len: int | None = None) -> list[int]:
    """The boundaries of ``cu_seqlens`` as ints, validated (ending at ``seq_len``, or
    wherever they end); :class:`ShardingError` otherwise."""
    return _bounds(cu_seqlens, seq_len)


def sequence_documents(
    seq_len: int, ring_size: int, ulysses_size: int, layout: str, cu_seqlens=None
) -> Documents:
    """The placement of a dense (``cu_seqlens=None``) or packed sequence; checks that it
    can be placed on ring x ulysses ranks and says what to pad otherwise."""
    if cu_seqlens is None:
        check_sequence_length(seq_len, ring_size, ulysses_size, layout)
        return Documents.single(seq_len, ring_size, layout)
    _check_layout(layout)
    try:
        docs = Documents.from_bounds(_bounds(cu_seqlens, seq_len), ring_size, layout)
    except ValueError as err:
        raise ShardingError(str(err)) from None
    if docs.local_len % ulysses_size:
        raise ShardingError(
            f"each ring rank holds {docs.local_len} tokens of the packed sequence, which must split "
            f"evenly over ulysses={ulysses_size}; pad with usp.pad_documents"
        )
    return docs


def sequence_positions(
    seq_len: int,
    *,
    ring_size: int,
    ring_rank: int,
    ulysses_size: int = 1,
    ulysses_rank: int = 0,
    layout: str = "zigzag",
    cu_seqlens=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global indices (int64, in local order) held by rank (ring_rank, ulysses_rank): the
    pure rank math, for any ring/Ulysses size without process groups."""
    docs = sequence_documents(seq_len, ring_size, ulysses_size, layout, cu_seqlens)
    return rank_token_indices(docs, ring_rank, ulysses_size, ulysses_rank).to(device)


def rank_token_indices(docs: Documents, ring_rank: int, ulysses_size: int, ulysses_rank: int):
    """Indices into the global sequence of the tokens rank (ring_rank, ulysses_rank)
    holds, in local order: the ring rank's block, cut into u contiguous pieces."""
    block = docs.block_positions(ring_rank)
    piece = block.numel() // ulysses_size
    return block[ulysses_rank * piece : (ulysses_rank + 1) * piece]


def gather_by_documents(x_local: torch.Tensor, topology, docs: Documents, dim: int):
    """Every SP rank's shard of ``x`` along ``dim`` put back in global order (a collective
    over ``topology.sp_group``; no gradient)."""
    sp_size = topology.sp_degree
    front = x_local.detach().movedim(dim, 0).contiguous()  # [L, ...]
    gathered = torch.empty(
        (sp_size * front.shape[0],) + front.shape[1:], dtype=front.dtype, device=front.device
    )
    all_gather_uncounted(gathered, front, topology.sp_group)
    u = topology.ulysses_degree
    full = torch.empty_like(gathered)
    for group_rank, piece in enumerate(gathered.chunk(sp_size)):
        # torch orders the sp group by global rank; find each piece's (ring, ulysses) place
        coords = topology.rank_map.coords_of(dist.get_global_rank(topology.sp_group, group_rank))
        indices = rank_token_indices(docs, coords.ring, u, coords.ulysses)
        full.index_copy_(0, indices.to(full.device), piece)
    return full.movedim(0, dim)


def _check_layout(layout: str) -> None:
    check_choice("sequence layout", layout, LAYOUTS, ShardingError)


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


def document_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document, for the whole packed sequence (int64).

    Shard it like the tokens (``shard_sequence(ids[None], topo, cu_seqlens=cu)``) or use
    :func:`local_position_ids`.
    """
    bounds = _bounds(cu_seqlens)
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    lengths = torch.tensor(bounds[1:], dtype=torch.int64) - starts
    return torch.arange(bounds[-1]) - torch.repeat_interleave(
        starts, lengths, output_size=bounds[-1]
    )


@dataclass(frozen=True)
class DocumentPadding:
    """How :func:`pad_documents` padded a packed sequence.

    ``cu_seqlens`` are the new boundaries; :meth:`apply` pads any tensor laid out like
    the tokens (input ids with the pad id, labels with the ignore index, ...).
    """

    cu_seqlens: torch.Tensor
    #: where each original token lands in the padded sequence
    destinations: torch.Tensor

    @property
    def padded_len(self) -> int:
        return int(self.cu_seqlens[-1])

    def apply(self, x: torch.Tensor, value, *, dim: int = 1) -> torch.Tensor:
        dim = dim % x.dim()
        if x.shape[dim] != self.destinations.numel():
            raise ShardingError(
                f"tensor has {x.shape[dim]} tokens along dim {dim}, the packed sequence {self.destinations.numel()}"
            )
        shape = list(x.shape)
        shape[dim] = self.padded_len
        padded = torch.full(shape, value, dtype=x.dtype, device=x.device)
        return padded.index_copy(dim, self.destinations.to(x.device), x)


def pad_documents(
    cu_seqlens: torch.Tensor, topology, *, layout: str | None = None
) -> DocumentPadding:
    """Pad every document of a packed sequence to what ``layout`` needs on ``topology``.

    ``topology`` may be a :class:`usp.Plan` (its layout is then the default).
    Each document grows at its end to a multiple of 2r (zigzag) or r (contiguous) tokens;
    if the ring blocks then do not split over the Ulysses ranks, one padding document is
    appended. For causal attention, pads at a document's end change nothing for its real
    tokens (no earlier token attends to them); give their labels the ignore index.
    A plan with ``placement="documents"`` pads only the documents it splits over the SP
    group, each to a multiple of its ``sequence_multiple`` (documents computed whole on
    one rank keep their lengths; nothing is appended).
    """
    layout = getattr(topology, "layout", "zigzag") if layout is None else layout
    _check_layout(layout)
    r, u = topology.ring_degree, topology.ulysses_degree
    bounds = _bounds(cu_seqlens)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if getattr(topology, "placement", "sequence") == "documents":
        padded = split_padding(
            lengths, ring=r, ulysses=u, layout=layout, multiple=topology.sequence_multiple,
            cost=topology.placement_cost,
        )  # fmt: skip
        return _padding(lengths, padded)
    chunks = layout_chunks(layout, r)
    padded = [-(-n // chunks) * chunks for n in lengths]
    # S/r = sum(padded)/r must be a multiple of u; a padding document of p*chunks tokens
    # adds p*chunks/r to it
    per_rank, step = sum(padded) // r, chunks // r
    extra = next(p for p in range(u) if (per_rank + p * step) % u == 0)
    return _padding(lengths, padded + ([extra * chunks] if extra else []))


def _padding(lengths: list[int], padded: list[int]) -> DocumentPadding:
    """Documents of ``lengths`` grown at their ends to ``padded`` (which may add
    documents after them)."""
    new_bounds = [0, *itertools.accumulate(padded)]
    old_starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], dtype=torch.int64)
    new_starts = torch.tensor(new_bounds[: len(lengths)], dtype=torch.int64)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    total = sum(lengths)
    offsets = torch.repeat_interleave(new_starts - old_starts, lengths_t, output_size=total)
    return DocumentPadding(
        cu_seqlens=torch.tensor(new_bounds, dtype=torch.int32),
        destinations=torch.arange(total) + offsets,
    )

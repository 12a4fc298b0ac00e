"""Where each token of a (packed) sequence lives on the ring.

A sequence is a list of documents; a dense sequence is one document. Every document is
cut into equal chunks, 2r for ``zigzag`` and r for ``contiguous``, and ring rank i's
block is made of *pieces*, each holding one chunk of every document, in document order:

    zigzag:     piece 0 = [chunk i of doc 0, chunk i of doc 1, ...]
                piece 1 = [chunk 2r-1-i of doc 0, chunk 2r-1-i of doc 1, ...]
    contiguous: piece 0 = [chunk i of doc 0, chunk i of doc 1, ...]

So every rank's block has the same shape (pieces of ``piece_len`` tokens with the same
per-document boundaries ``piece_bounds``), and with zigzag every rank does the same
causal work on every document. For one document this is the familiar layout: rank i
holds chunks i and 2r-1-i of the sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from usp.errors import InputError
from usp.options import LAYOUTS, check_choice, layout_chunks


class DocumentLayoutError(InputError):
    """Document boundaries that the layout cannot place."""


def check_layout(layout: str) -> None:
    check_choice("sequence layout", layout, LAYOUTS, DocumentLayoutError)


def ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop;
    ``total`` = sum of the lengths, known on the host (no read-back of ``lengths``)."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total) + torch.repeat_interleave(
        starts - offsets, lengths, output_size=total
    )


@dataclass(frozen=True)
class Documents:
    lengths: tuple[int, ...]
    ring_size: int
    layout: str

    def __post_init__(self):
        check_layout(self.layout)
        for index, length in enumerate(self.lengths):
            if length % self.chunks_per_doc:
                kind = "the sequence" if len(self.lengths) == 1 else f"document {index}"
                raise DocumentLayoutError(
                    f"{kind} has {length} tokens; the {self.layout} layout on a ring of {self.ring_size} "
                    f"cuts every document into {self.chunks_per_doc} equal chunks, so it needs a multiple of "
                    f"{self.chunks_per_doc} (pad documents with usp.pad_documents)"
                )

    @classmethod
    def from_bounds(cls, bounds: list[int], ring_size: int, layout: str) -> Documents:
        """From cumulative boundaries [0, ..., S] (already validated); empty documents dropped."""
        lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]) if b > a)
        return cls(lengths or (0,), ring_size, layout)

    @classmethod
    def single(cls, seq_len: int, ring_size: int, layout: str) -> Documents:
        return cls((seq_len,), ring_size, layout)

    # ------------------------------------------------------------------ sizes
    @property
    def chunks_per_doc(self) -> int:
        return layout_chunks(self.layout, self.ring_size)

    @property
    def pieces(self) -> int:
        return layout_chunks(self.layout, 1)

    # Sizes are plain Python arithmetic on ``lengths`` (no tensors, no host syncs, no
    # caches with locks), so ``torch.compile`` traces them as constants.
    @property
    def chunk_lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.int64) // self.chunks_per_doc

    @property
    def piece_len(self) -> int:
        return sum(self.lengths) // self.chunks_per_doc

    @property
    def local_len(self) -> int:
        return self.piece_len * self.pieces

    @property
    def piece_bounds(self) -> list[int]:
        """Cumulative document boundaries inside one piece (the same on every rank)."""
        return [0, *itertools.accumulate(n // self.chunks_per_doc for n in self.lengths)]

    def piece_rows(self, piece: int) -> slice:
        return slice(piece * self.piece_len, (piece + 1) * self.piece_len)

    def chunk_of(self, ring_rank: int, piece: int) -> int:
        """Which chunk of each document piece ``piece`` of ``ring_rank`` holds."""
        return ring_rank if piece == 0 else 2 * self.ring_size - 1 - ring_rank

    # ------------------------------------------------------------------ positions
    @property
    def _doc_starts(self) -> torch.Tensor:
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        return torch.cumsum(lengths, 0) - lengths

    def block_positions(self, ring_rank: int) -> torch.Tensor:
        """Global positions of ring rank's block, in block order (int64 [local_len])."""
        parts = []
        for piece in range(self.pieces):
            chunk = self.chunk_of(ring_rank, piece)
            starts = self._doc_starts + chunk * self.chunk_lengths
            parts.append(ranges(starts, self.chunk_lengths, self.piece_len))
        return torch.cat(parts)

    def gathered_rows(self, num_chunks: int) -> tuple[torch.Tensor, list[int]]:
        """Rows of the ring's blocks concatenated in ring-rank order ([r * local_len])
        holding chunks ``0 .. num_chunks-1`` of every document, document by document in
        position order; and the cumulative per-document boundaries of that selection."""
        chunks = torch.arange(num_chunks)
        second = chunks >= self.ring_size  # zigzag chunks r..2r-1 sit in piece 1 of rank 2r-1-c
        owner = torch.where(second, 2 * self.ring_size - 1 - chunks, chunks)
        chunk_offset = owner * self.local_len + second.long() * self.piece_len  # [C]
        doc_offset = torch.tensor(self.piece_bounds[:-1], dtype=torch.int64)  # [N]
        starts = doc_offset[:, None] + chunk_offset[None, :]  # [N, C], document-major
        lengths = self.chunk_lengths[:, None].expand(-1, num_chunks)
        per_document = lengths.sum(1)
        bounds = [0, *torch.cumsum(per_document, 0).tolist()]
        total = int(per_document.sum())
        return ranges(starts.reshape(-1), lengths.reshape(-1), total), bounds

    def visible_rows(
        self, ring_rank: int, piece: int, causal: bool
    ) -> tuple[torch.Tensor, list[int]]:
        """Keys that piece ``piece`` of ``ring_rank`` attends to, per document, in order:
        every chunk of its document, or (causal) the chunks up to its own, so the causal
        mask is bottom-right aligned within each document."""
        chunk = self.chunk_of(ring_rank, piece)
        return self.gathered_rows(chunk + 1 if causal else self.chunks_per_doc)

    def window_rows(self, ring_rank: int, piece: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """:meth:`visible_rows` (causal) of a sliding window of w keys before each query
        (the kernels' left window): per document of chunk length n, only the keys from
        the first one the piece's first query reaches, position ``chunk * n - w`` of the
        document (clamped at its start), to the piece's last query. The last key is still
        the last query's own, so the kernels' bottom-right causal alignment holds."""
        chunk = self.chunk_of(ring_rank, piece)
        n = self.chunk_lengths
        first = (chunk * n - w).clamp(min=0)  # [N] the first key, relative to its document
        lengths = (chunk + 1) * n - first
        positions = ranges(self._doc_starts + first, lengths, int(lengths.sum()))
        bounds = [0, *torch.cumsum(lengths, 0).tolist()]
        return self.rows_of_positions[positions], bounds

    @property
    def rows_of_positions(self) -> torch.Tensor:
        """int64 [S]: the row of each global position in the ring's blocks concatenated
        in ring-rank order (the inverse of every rank's :meth:`block_positions`)."""
        positions = torch.cat([self.block_positions(rank) for rank in range(self.ring_size)])
        rows = torch.empty_like(positions)
        rows[positions] = torch.arange(positions.numel())
        return rows

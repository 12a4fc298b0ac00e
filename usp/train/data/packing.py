"""Packing documents into fixed-length sequences, and per-replica micro-batches.

Every epoch visits the documents in a seeded permutation and packs them greedily into
sequences of ``seq_len`` tokens; each document is padded at its end to a multiple of
``document_multiple`` and the rest of a sequence is one padding document (pads carry the
ignore label). Documents are at most ``seq_len`` long (the ``long_documents`` policy of
:mod:`usp.train.data.records` has run). Step ``t`` of a :class:`DataLoader` consumes
global sequences ``[position, position + global_batch)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from usp.errors import DataError
from usp.models.labels import shift_labels
from usp.train.data.corpus import Corpus
from usp.train.data.records import IGNORE_INDEX, Document


# ----------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class PackedRow:
    """One packed sequence of exactly ``seq_len`` tokens."""

    tokens: torch.Tensor  # int64 [seq_len]
    target: torch.Tensor  # bool [seq_len]: pads and prompt tokens are False
    lengths: tuple[int, ...]  # document lengths after padding (the last may be padding)


class PackedDataset:
    """Documents packed into fixed-length sequences, epoch after epoch (see module doc).

    Sequence ``g`` (a global index over all epochs) is the same on every rank and in every
    run with the same documents, ``seq_len``, ``document_multiple``, ``seed`` and
    ``shuffle``.
    """

    def __init__(
        self,
        documents: Sequence[Document] | Corpus,
        *,
        seq_len: int,
        document_multiple: int,
        pad_id: int,
        seed: int,
        shuffle: bool = True,
    ):
        corpus = documents if isinstance(documents, Corpus) else Corpus.from_documents(documents)
        if not len(corpus):
            raise DataError("no documents to pack")
        if seq_len % document_multiple:
            raise DataError(
                f"seq_len({seq_len}) is not a multiple of document_multiple({document_multiple})"
            )
        longest = int((corpus.offsets[1:] - corpus.offsets[:-1]).max())
        if longest > seq_len:
            raise DataError(
                f"a document of {longest} tokens is longer than seq_len({seq_len}); apply the "
                "long_documents policy (usp.train.data.fit_document) first"
            )
        self.documents = corpus
        self.seq_len = seq_len
        self.document_multiple = document_multiple
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self._epochs: list[tuple[torch.Tensor, list[int]]] = []  # packed epochs so far
        self._starts: list[int] = [0]  # global index of each epoch's first sequence
        self.notes: list[str] = []  # what reading the data did (the start-up report)

    # -------------------------------------------------------------- epoch plans
    def _order(self, epoch: int) -> list[int]:
        n = len(self.documents)
        if not self.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def _pack_epoch(self, epoch: int) -> tuple[torch.Tensor, list[int]]:
        """The epoch's document order and where each sequence starts in it: greedy
        packing takes documents in order, so sequence ``i`` is
        ``order[starts[i]:starts[i + 1]]`` (a few bytes per document, not per token)."""
        m, cap = self.document_multiple, self.seq_len
        lengths = self.documents.lengths()
        order = self._order(epoch)
        starts, used = [0], 0
        for position, doc in enumerate(order):
            padded = -(-lengths[doc] // m) * m
            if used + padded > cap:
                starts.append(position)
                used = 0
            used += padded
        starts.append(len(order))
        return torch.tensor(order, dtype=torch.int64), starts

    def _locate(self, index: int) -> tuple[int, int]:
        while index >= self._starts[-1]:
            epoch = len(self._epochs)
            self._epochs.append(self._pack_epoch(epoch))
            self._starts.append(self._starts[-1] + len(self._epochs[-1][1]) - 1)
        epoch = bisect.bisect_right(self._starts, index) - 1
        return epoch, index - self._starts[epoch]

    # -------------------------------------------------------------- sequences
    def document_ids(self, index: int) -> list[int]:
        """The corpus indices of the documents packed into sequence ``index``, in order."""
        if index < 0:
            raise IndexError(f"sequence index must be >= 0, got {index}")
        epoch, i = self._locate(index)
        order, starts = self._epochs[epoch]
        return order[starts[i] : starts[i + 1]].tolist()

    def sequence(self, index: int) -> PackedRow:
        """The packed sequence with global index ``index`` (>= 0)."""
        tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        target = torch.zeros(self.seq_len, dtype=torch.bool)
        lengths, offset, m = [], 0, self.document_multiple
        corpus = self.documents
        for doc in self.document_ids(index):
            start, length = (
                int(corpus.offsets[doc]),
                int(corpus.offsets[doc + 1] - corpus.offsets[doc]),
            )
            tokens[offset : offset + length] = corpus.tokens[start : start + length]
            target[offset : offset + length] = corpus.target[start : start + length]
            padded = -(-length // m) * m
            lengths.append(padded)
            offset += padded
        if offset < self.seq_len:
            lengths.append(self.seq_len - offset)  # one padding document fills the rest
        return PackedRow(tokens, target, tuple(lengths))

    def epoch_of(self, index: int) -> int:
        return self._locate(index)[0]

    def sequences_in_epoch(self, epoch: int) -> int:
        while epoch >= len(self._epochs):
            self._locate(self._starts[-1])
        return self._starts[epoch + 1] - self._starts[epoch]

    def summary(self, sequences: int) -> list[str]:
        """Start-up lines: the documents, what was done to long ones, and how many epochs
        a run of ``sequences`` global sequences covers."""
        per_epoch = self.sequences_in_epoch(0)
        return [
            f"{len(self.documents)} documents, {self.documents.num_tokens} tokens, packed into "
            f"sequences of {self.seq_len} tokens: {per_epoch} sequences per epoch; the run's "
            f"{sequences} sequences cover {self.epochs_covered(sequences):.2f} epochs",
            *self.notes,
        ]

    def epochs_covered(self, sequences: int) -> float:
        """How many epochs the first ``sequences`` global sequences span (fractional)."""
        if sequences <= 0:
            return 0.0
        epoch, i = self._locate(sequences - 1)
        return epoch + (i + 1) / self.sequences_in_epoch(epoch)


# ----------------------------------------------------------------------------- batches
@dataclass(frozen=True)
class MicroBatch:
    """One forward pass of one dp replica: the global (unsharded) packed row."""

    input_ids: torch.Tensor  # int64 [1, micro_batch * seq_len]
    labels: torch.Tensor  # int64 [1, micro_batch * seq_len], globally shifted
    cu_seqlens: torch.Tensor  # int32 [documents + 1], boundaries in the row

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class StepBatch:
    """What one dp replica trains on in one optimizer step."""

    micro_batches: list[MicroBatch]
    num_labels: int  # non-ignored labels of the whole global batch (every replica)
    first_sequence: int  # global index of the step's first sequence
    document_lengths: list[int]  # of the whole global batch, padding documents included


def _cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _labels_of(sequence: PackedRow) -> torch.Tensor:
    return _shifted(sequence.tokens, sequence.target, _cu_seqlens(sequence.lengths))


def _shifted(tokens: torch.Tensor, target: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    masked = torch.where(target, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return shift_labels(masked, cu_seqlens=cu_seqlens, ignore_index=IGNORE_INDEX)


def micro_batch_of(sequences: Sequence[PackedRow]) -> MicroBatch:
    """Concatenate packed sequences into one row with concatenated document boundaries."""
    tokens = torch.cat([s.tokens for s in sequences])
    target = torch.cat([s.target for s in sequences])
    cu = _cu_seqlens([n for s in sequences for n in s.lengths])
    return MicroBatch(tokens[None], _shifted(tokens, target, cu)[None], cu)


class DataLoader:
    """This dp replica's micro-batches, step after step; ``position`` is the whole state.

    Step ``t`` covers global sequences ``[position, position + global_batch)``: replica
    ``d`` takes ``accumulation * micro_batch`` consecutive ones starting at
    ``position + d * accumulation * micro_batch``, in micro-batches of ``micro_batch``.
    The split of one global batch over replicas and micro-batches changes nothing in the
    optimizer step when the loss is normalised by the step's label count
    (:meth:`step_label_count`).
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        global_batch: int,
        micro_batch: int,
        dp_degree: int,
        dp_rank: int,
        position: int = 0,
    ):
        if global_batch % (micro_batch * dp_degree):
            raise DataError(
                f"global_batch({global_batch}) is not a multiple of micro_batch({micro_batch}) "
                f"* dp({dp_degree})"
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.accumulation = global_batch // (micro_batch * dp_degree)
        self.dp_rank = dp_rank
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    def next_step(self) -> StepBatch:
        """This replica's micro-batches of the next step, and the label count of the whole
        global batch (all replicas; every rank computes it from the same data, without
        communication). Advances ``position`` by ``global_batch``."""
        start, share = self.position, self.accumulation * self.micro_batch
        sequences = [self.dataset.sequence(g) for g in range(start, start + self.global_batch)]
        mine = sequences[self.dp_rank * share : (self.dp_rank + 1) * share]
        micro = [
            micro_batch_of(mine[a : a + self.micro_batch])
            for a in range(0, share, self.micro_batch)
        ]
        # the last label of a sequence is always ignored (end of its last document), so
        # counting per sequence equals counting the concatenated rows
        total = sum(int(_labels_of(s).ne(IGNORE_INDEX).sum()) for s in sequences)
        lengths = [n for s in sequences for n in s.lengths]
        self.position += self.global_batch
        return StepBatch(micro, total, start, lengths)

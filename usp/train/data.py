"""Training data: documents -> packed fixed-length sequences -> per-rank micro-batches.

Pipeline (deterministic given the seed, the same on every rank):

1. **Documents** (:class:`Document`): token ids plus a per-token ``target`` flag (False
   for prompt tokens of prompt/completion pairs, which carry no loss). They come from
   JSONL files (``"text"``, ``"input_ids"``, or ``"prompt"`` + ``"completion"`` per line),
   tokenised once at start-up, or from :func:`synthetic_documents` (a generated recall
   task for the CPU demo).
2. **Packing** (:class:`PackedDataset`): every epoch visits the documents in a seeded
   permutation and packs them greedily into sequences of ``seq_len`` tokens. Each
   document is padded at its end to a multiple of ``document_multiple`` (what the
   sequence layout needs, see :func:`usp.pad_documents`), and the rest of a sequence is
   one padding document; pads carry the ignore label. A document longer than
   ``seq_len`` is cut into pieces of at most ``seq_len`` tokens.
3. **Batches** (:class:`DataLoader`): step ``t`` consumes global sequences
   ``[position, position + global_batch)``; dp replica ``d`` takes the ``d``-th contiguous
   share, one micro-batch after another. A micro-batch of several sequences is
   concatenated into one packed row (their document boundaries concatenated), so a
   forward always sees ``[1, micro_batch * seq_len]`` tokens. ``position`` is the whole
   loader state (saved in checkpoints).

Labels are the global next-token shift (:func:`usp.models.shift_labels`) of the tokens
with non-target tokens masked, so a label is ignored when the token it predicts is a
prompt token, a pad, or the first token of the next document.
"""

from __future__ import annotations

import bisect
import json
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from usp.errors import DataError  # noqa: F401 - re-exported here

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """Bytes of UTF-8 text as token ids (vocabulary 256). Control bytes that do not occur
    in text serve as special tokens: STX (2) begins a document, ETX (3) ends it, NUL (0)
    pads."""

    vocab_size = 256
    bos_id = 2
    eos_id = 3
    pad_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library (lazily imported).

    Special tokens are not added by the tokenizer's post-processor; BOS/EOS come from the
    model config (``bos_token_id``/``eos_token_id``), so every document gets exactly one.
    """

    def __init__(self, path: Path, *, bos_id: int | None, eos_id: int | None, pad_id: int | None):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - tokenizers is installed with transformers
            raise DataError(
                f"reading {path} needs the tokenizers library: pip install tokenizers "
                '(or use tokenizer = "byte" in [data])'
            ) from None
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist")
        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def _first_id(value) -> int | None:
    """``bos_token_id``/``eos_token_id`` may be a list in HF configs (the first is used)."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def build_tokenizer(spec: str, *, model_dir: Path | None, model_config, config_dir: Path):
    """``"byte"``, ``"auto"`` (the model directory's ``tokenizer.json``; byte-level for a
    preset) or a path to a ``tokenizer.json`` (relative to the config file)."""
    if spec == "byte" or (spec == "auto" and model_dir is None):
        return ByteTokenizer()
    path = model_dir / "tokenizer.json" if spec == "auto" else config_dir / Path(spec).expanduser()
    if spec == "auto" and not path.is_file():
        raise DataError(
            f'[data] tokenizer = "auto" reads {path}, which does not exist; give the path '
            'of a tokenizer.json, or tokenizer = "byte"'
        )
    return HFTokenizer(
        path,
        bos_id=_first_id(model_config.bos_token_id),
        eos_id=_first_id(model_config.eos_token_id),
        pad_id=model_config.pad_token_id,
    )


# ----------------------------------------------------------------------------- documents
@dataclass(frozen=True)
class Document:
    """Token ids and, per token, whether predicting it carries loss (int64, bool)."""

    tokens: torch.Tensor
    target: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.numel()


def _document(pieces: list[tuple[list[int], bool]]) -> Document:
    tokens = [t for ids, _ in pieces for t in ids]
    target = [flag for ids, flag in pieces for _ in ids]
    return Document(torch.tensor(tokens, dtype=torch.int64), torch.tensor(target, dtype=torch.bool))


def _with_specials(tokenizer, ids: list[int], *, bos: bool, eos: bool) -> list[int]:
    head = [tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []
    tail = [tokenizer.eos_id] if eos and tokenizer.eos_id is not None else []
    return head + ids + tail


def document_from_record(record, tokenizer, *, where: str) -> Document:
    """One JSONL record: ``{"text"}``, ``{"input_ids"}`` or ``{"prompt", "completion"}``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        ids = record["input_ids"]
        vocab = tokenizer.vocab_size
        if not (isinstance(ids, list) and all(isinstance(i, int) and 0 <= i < vocab for i in ids)):
            raise DataError(f'{where}: "input_ids" must be a list of integers in [0, {vocab})')
        return _document([(ids, True)])
    if "text" in record:
        text = _text(record, "text", where)
        return _document(
            [(_with_specials(tokenizer, tokenizer.encode(text), bos=True, eos=True), True)]
        )
    if "prompt" in record and "completion" in record:
        prompt = _with_specials(
            tokenizer, tokenizer.encode(_text(record, "prompt", where)), bos=True, eos=False
        )
        completion = _with_specials(
            tokenizer, tokenizer.encode(_text(record, "completion", where)), bos=False, eos=True
        )
        return _document([(prompt, False), (completion, True)])
    raise DataError(
        f'{where}: a record needs "text", "input_ids", or "prompt" and "completion"; '
        f"got keys {sorted(record)}"
    )


def _text(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f'{where}: "{key}" must be a string, got {type(value).__name__}')
    return value


def read_jsonl(paths: Sequence[Path], tokenizer) -> list[Document]:
    """Every non-empty line of every file, tokenised (documents shorter than 2 tokens, which
    have nothing to predict, are skipped)."""
    documents = []
    for path in paths:
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: invalid JSON: {err}") from None
                doc = document_from_record(record, tokenizer, where=where)
                if len(doc) >= 2:
                    documents.append(doc)
    if not documents:
        raise DataError(f"no documents with at least 2 tokens in {', '.join(map(str, paths))}")
    return documents


# ----------------------------------------------------------------------------- synthetic task
def synthetic_documents(count: int, *, length: int, seed: int, tokenizer=None) -> list[Document]:
    """A long-range retrieval task, generated (nothing downloaded).

    A document is a prompt of random lowercase letters with one uppercase letter (the
    needle) somewhere in its first half, ending in ``?``; the completion is the needle and
    the end-of-document token. Only the completion carries loss (prompt tokens are masked,
    as in supervised fine-tuning), so the loss starts at ``ln(256)`` (any byte), falls to
    about ``ln(26) / 2 = 1.63`` once the model answers "some uppercase letter, then the
    end", and falls further only if the token at ``?`` attends to the needle -- which
    under sequence parallelism lies on another rank for most documents (in the zigzag
    layout a document's first chunks and its last sit on different ranks). Filler
    lengths are drawn from ``[length / 2, length]``, so packing has work to do.
    """
    tokenizer = tokenizer or ByteTokenizer()
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        filler = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(length // 2, length)))
        needle = rng.choice(string.ascii_uppercase)
        at = rng.randint(0, len(filler) // 2)
        prompt = _with_specials(
            tokenizer, tokenizer.encode(f"{filler[:at]}{needle}{filler[at:]}?"), bos=True, eos=False
        )
        answer = _with_specials(tokenizer, tokenizer.encode(needle), bos=False, eos=True)
        documents.append(_document([(prompt, False), (answer, True)]))
    return documents


# ----------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class PackedSequence:
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
        documents: Sequence[Document],
        *,
        seq_len: int,
        document_multiple: int,
        pad_id: int,
        seed: int,
        shuffle: bool = True,
    ):
        if not documents:
            raise DataError("no documents to pack")
        if seq_len % document_multiple:
            raise DataError(
                f"seq_len({seq_len}) is not a multiple of document_multiple({document_multiple})"
            )
        self.documents = list(documents)
        self.seq_len = seq_len
        self.document_multiple = document_multiple
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self._epochs: list[list[list[tuple[int, int, int]]]] = []  # packed epochs so far
        self._starts: list[int] = [0]  # global index of each epoch's first sequence

    # -------------------------------------------------------------- epoch plans
    def _order(self, epoch: int) -> list[int]:
        n = len(self.documents)
        if not self.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def _pack_epoch(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        """Sequences as lists of ``(document, start, length)`` pieces."""
        m, cap = self.document_multiple, self.seq_len
        sequences, current, used = [], [], 0
        for doc in self._order(epoch):
            length = len(self.documents[doc])
            for start in range(0, length, cap):
                piece = min(cap, length - start)
                padded = -(-piece // m) * m
                if used + padded > cap:
                    sequences.append(current)
                    current, used = [], 0
                current.append((doc, start, piece))
                used += padded
        if current:
            sequences.append(current)
        return sequences

    def _locate(self, index: int) -> tuple[int, int]:
        while index >= self._starts[-1]:
            epoch = len(self._epochs)
            self._epochs.append(self._pack_epoch(epoch))
            self._starts.append(self._starts[-1] + len(self._epochs[-1]))
        epoch = bisect.bisect_right(self._starts, index) - 1
        return epoch, index - self._starts[epoch]

    # -------------------------------------------------------------- sequences
    def sequence(self, index: int) -> PackedSequence:
        """The packed sequence with global index ``index`` (>= 0)."""
        if index < 0:
            raise IndexError(f"sequence index must be >= 0, got {index}")
        epoch, i = self._locate(index)
        tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        target = torch.zeros(self.seq_len, dtype=torch.bool)
        lengths, offset, m = [], 0, self.document_multiple
        for doc, start, piece in self._epochs[epoch][i]:
            document = self.documents[doc]
            tokens[offset : offset + piece] = document.tokens[start : start + piece]
            target[offset : offset + piece] = document.target[start : start + piece]
            padded = -(-piece // m) * m
            lengths.append(padded)
            offset += padded
        if offset < self.seq_len:
            lengths.append(self.seq_len - offset)  # one padding document fills the rest
        return PackedSequence(tokens, target, tuple(lengths))

    def epoch_of(self, index: int) -> int:
        return self._locate(index)[0]


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


def _labels_of(sequence: PackedSequence) -> torch.Tensor:
    return _shifted(sequence.tokens, sequence.target, _cu_seqlens(sequence.lengths))


def _shifted(tokens: torch.Tensor, target: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    from usp.models import shift_labels

    masked = torch.where(target, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return shift_labels(masked, cu_seqlens=cu_seqlens, ignore_index=IGNORE_INDEX)


def micro_batch_of(sequences: Sequence[PackedSequence]) -> MicroBatch:
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

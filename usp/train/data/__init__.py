"""Training data: documents -> packed fixed-length sequences -> per-rank micro-batches.

Pipeline (deterministic given the seed, the same on every rank):

1. **Documents** (:mod:`~usp.train.data.records`): token ids plus a per-token ``target``
   flag (False for tokens that carry no loss: prompts, non-assistant chat turns, labels
   of -100). They come from JSONL files (``"text"``, ``"prompt"`` + ``"completion"``,
   ``"input_ids"`` (+ ``"labels"``) or chat ``"messages"`` per line), or from
   :func:`synthetic_documents` (a generated recall task for the CPU demo). Documents
   longer than ``seq_len`` follow ``[data] long_documents`` (:func:`fit_document`).
2. **The corpus** (:mod:`~usp.train.data.corpus`): the documents stored flat, tokenised
   once into a memory-mapped cache in the output directory that every rank maps.
3. **Packing** (:class:`PackedDataset`): every epoch visits the documents in a seeded
   permutation and packs them greedily into sequences of ``seq_len`` tokens. Each
   document is padded at its end to a multiple of ``document_multiple`` (what the
   sequence layout needs, see :func:`usp.pad_documents`), and the rest of a sequence is
   one padding document; pads carry the ignore label.
4. **Batches** (:class:`DataLoader`): step ``t`` consumes global sequences
   ``[position, position + global_batch)``; dp replica ``d`` takes the ``d``-th contiguous
   share, one micro-batch after another. A micro-batch of several sequences is
   concatenated into one packed row (their document boundaries concatenated), so a
   forward always sees ``[1, micro_batch * seq_len]`` tokens. ``position`` is the whole
   loader state (saved in checkpoints).

Labels are the global next-token shift (:func:`usp.models.shift_labels`) of the tokens
with non-target tokens masked, so a label is ignored when the token it predicts is not a
target, a pad, or the first token of the next document.
"""

from usp.errors import DataError
from usp.train.data.corpus import Corpus, CorpusBuilder, cache_key, load_cache
from usp.train.data.packing import (
    DataLoader,
    MicroBatch,
    PackedDataset,
    PackedRow,
    StepBatch,
    micro_batch_of,
)
from usp.train.data.records import (
    IGNORE_INDEX,
    Document,
    LengthReport,
    document_from_record,
    fit_document,
    iter_documents,
    jsonl_records,
    read_jsonl,
    resolve_files,
    synthetic_documents,
)
from usp.train.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "Corpus",
    "CorpusBuilder",
    "DataError",
    "DataLoader",
    "Document",
    "HFTokenizer",
    "LengthReport",
    "MicroBatch",
    "PackedDataset",
    "PackedRow",
    "StepBatch",
    "build_tokenizer",
    "cache_key",
    "document_from_record",
    "fit_document",
    "iter_documents",
    "jsonl_records",
    "load_cache",
    "micro_batch_of",
    "read_jsonl",
    "resolve_files",
    "synthetic_documents",
]

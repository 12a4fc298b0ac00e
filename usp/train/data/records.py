"""Documents: JSONL records -> token ids with a per-token loss flag, and the
``long_documents`` policy for documents longer than ``seq_len``.

A record is exactly one of (other keys, e.g. an ``"id"``, are ignored):

- ``{"text": str}``: BOS + text + EOS, every token trained;
- ``{"prompt": str, "completion": str}``: BOS + prompt (not trained) + completion + EOS;
- ``{"input_ids": [int], "labels": [int]}``: the ids as given, no specials added; a
  token is trained where its label is not -100 (the HF convention: ``labels`` aligned
  with ``input_ids``, unshifted; without ``labels`` every token is trained);
- ``{"messages": [{"role", "content"}, ...]}``: rendered with the chat template (see
  :mod:`usp.train.data.chat`), assistant turns trained.
"""

from __future__ import annotations

import glob
import json
import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from usp.errors import DataError, MissingDataFile
from usp.models.labels import IGNORE_INDEX  # the one definition (HF's -100)
from usp.train.data.chat import ChatRenderer
from usp.train.data.tokenizer import ByteTokenizer

FORMATS = {
    "text": ("text",),
    "prompt/completion": ("prompt", "completion"),
    "input_ids": ("input_ids", "labels"),
    "messages": ("messages",),
}


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


# ----------------------------------------------------------------------------- records
def record_format(record: dict, where: str) -> str:
    """The record's format; several formats at once, or half of one, is an error."""
    found = [name for name, keys in FORMATS.items() if any(k in record for k in keys)]
    if len(found) > 1:
        keys = sorted(k for name in found for k in FORMATS[name] if k in record)
        raise DataError(
            f"{where}: the record has several formats at once (keys {keys}); give exactly one "
            'of "text", "prompt" + "completion", "input_ids" (+ "labels"), "messages"'
        )
    if not found:
        raise DataError(
            f'{where}: a record needs "text", "input_ids", "prompt" and "completion", or '
            f'"messages"; got keys {sorted(record)}'
        )
    (name,) = found
    if name == "prompt/completion" and not ("prompt" in record and "completion" in record):
        missing = "completion" if "prompt" in record else "prompt"
        raise DataError(f'{where}: "prompt" and "completion" go together; "{missing}" is missing')
    if name == "input_ids" and "input_ids" not in record:
        raise DataError(f'{where}: "labels" needs the "input_ids" they label')
    return name


def document_from_record(record, tokenizer, *, where: str, chat=None) -> Document:
    """One JSONL record (see the module doc); ``chat`` renders ``"messages"`` records."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kind = record_format(record, where)
    if kind == "input_ids":
        return _ids_document(record, tokenizer.vocab_size, where)
    if kind == "text":
        text = _text(record, "text", where)
        return _document(
            [(_with_specials(tokenizer, tokenizer.encode(text), bos=True, eos=True), True)]
        )
    if kind == "prompt/completion":
        prompt = _with_specials(
            tokenizer, tokenizer.encode(_text(record, "prompt", where)), bos=True, eos=False
        )
        completion = _with_specials(
            tokenizer, tokenizer.encode(_text(record, "completion", where)), bos=False, eos=True
        )
        return _document([(prompt, False), (completion, True)])
    if chat is None:
        chat = ChatRenderer(tokenizer)
    ids, target = chat.document(record["messages"], where=where)
    return Document(torch.tensor(ids, dtype=torch.int64), torch.tensor(target, dtype=torch.bool))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids_document(record: dict, vocab: int, where: str) -> Document:
    ids = record["input_ids"]
    if not isinstance(ids, list):
        raise DataError(
            f'{where}: "input_ids" must be a list of integers, got {type(ids).__name__}'
        )
    bad = next((i for i in ids if not (_is_int(i) and 0 <= i < vocab)), None)
    if bad is not None:
        raise DataError(
            f'{where}: "input_ids" must be a list of integers in [0, {vocab}), found {bad!r}'
        )
    labels = record.get("labels")
    if labels is None:
        return _document([(ids, True)])
    if not (isinstance(labels, list) and len(labels) == len(ids)):
        got = f"{len(labels)} entries" if isinstance(labels, list) else type(labels).__name__
        raise DataError(
            f'{where}: "labels" must be a list as long as "input_ids" ({len(ids)}), got {got}'
        )
    for i, (token, label) in enumerate(zip(ids, labels, strict=True)):
        if not (_is_int(label) and label in (IGNORE_INDEX, token)):
            raise DataError(
                f"{where}: labels[{i}] = {label!r} but input_ids[{i}] = {token}; a label is "
                f"{IGNORE_INDEX} (not trained) or the token itself (labels aligned with input_ids, "
                "not shifted: usp shifts them)"
            )
    return Document(
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor([label != IGNORE_INDEX for label in labels], dtype=torch.bool),
    )


def _text(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f'{where}: "{key}" must be a string, got {type(value).__name__}')
    return value


# ----------------------------------------------------------------------------- files
def resolve_files(patterns: Sequence[str], base: Path, *, key: str = "[data] files") -> list[Path]:
    """``[data] files`` (or another ``key``'s) as paths: relative ones to ``base`` (the
    config's directory); a pattern with ``*``, ``?`` or ``[`` is a glob (``**``
    recursive), expanded sorted, and must match at least one file."""
    paths: list[Path] = []
    seen: dict[Path, str] = {}
    for pattern in patterns:
        full = Path(pattern).expanduser()
        full = full if full.is_absolute() else base / full
        if glob.has_magic(pattern):
            matches = [Path(p) for p in sorted(glob.glob(str(full), recursive=True))]
            matches = [p for p in matches if not p.is_dir()]
            if not matches:
                raise MissingDataFile(f"{key} pattern {pattern!r} matches no file ({full})")
        else:
            if full.is_dir():
                raise DataError(
                    f"data file {full} is a directory, expected a JSONL file; to read every "
                    f'file in it, give a glob such as "{Path(pattern) / "*.jsonl"}"'
                )
            if not full.is_file():
                raise MissingDataFile(f"data file {full} does not exist")
            matches = [full]
        for path in matches:
            key = path.resolve()
            if key in seen:
                raise DataError(
                    f"data file {path} is listed twice (by {seen[key]!r} and {pattern!r}); list "
                    "each file once"
                )
            seen[key] = pattern
            paths.append(path)
    return paths


def jsonl_records(path: Path, report: LengthReport) -> Iterator[tuple[object, str]]:
    """``(record, "file:line")`` for every non-empty line (blank ones counted in ``report``);
    bad UTF-8 or JSON is a :class:`DataError` naming the file and line."""
    if path.is_dir():
        raise DataError(f"data file {path} is a directory, expected a JSONL file")
    if not path.is_file():
        raise MissingDataFile(f"data file {path} does not exist")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); convert the file to UTF-8"
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark
            if not line.strip():
                report.blank_lines += 1  # said at start-up (LengthReport.describe)
                continue
            try:
                yield json.loads(line), where
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: invalid JSON: {err}") from None


# ----------------------------------------------------------------------------- long documents
@dataclass
class LengthReport:
    """What the ``long_documents`` policy did (the start-up report)."""

    policy: str
    seq_len: int
    too_long: int = 0  # documents longer than seq_len
    longest: int = 0
    pieces: int = 0  # split: pieces made of them
    cut_start: int = 0  # truncate: the prompt's start cut (its first token kept)
    cut_end: int = 0  # truncate: the end cut
    # dropped with no trained token left: truncate's kept window, or a piece of split
    emptied: int = 0
    short: int = 0  # documents under 2 tokens (nothing to predict), skipped
    blank_lines: int = 0  # blank lines of the JSONL files, skipped
    #: per data file: records read, documents kept, their tokens and trained tokens
    files: dict[str, dict[str, int]] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.too_long:
            text = f"no document longer than seq_len({self.seq_len})"
        else:
            head = (
                f"{self.too_long} document{'s' if self.too_long > 1 else ''} longer than "
                f"seq_len({self.seq_len}) (longest {self.longest} tokens)"
            )
            if self.policy == "split":
                text = f"{head}: split into {self.pieces} pieces of at most {self.seq_len}"
                if self.emptied:
                    text += f"; {self.emptied} of them dropped, no trained token in them"
            elif self.policy == "drop":
                text = f"{head}: dropped"
            else:
                text = (
                    f"{head}: truncated to {self.seq_len} tokens (the prompt's start cut for "
                    f"{self.cut_start}, the end cut for {self.cut_end}"
                    + (f"; {self.emptied} dropped, no trained token left" if self.emptied else "")
                    + ")"
                )
        if self.short:
            text += f"; {self.short} documents under 2 tokens skipped"
        text += f"; {self.blank_lines} blank JSONL line(s) skipped" if self.blank_lines else ""
        return text

    def add(self, other: LengthReport) -> None:
        for name in ("too_long", "pieces", "cut_start", "cut_end", "emptied", "short", "blank_lines"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest = max(self.longest, other.longest)
        for path, counts in other.files.items():
            mine = self.files.setdefault(path, dict.fromkeys(FILE_COUNTS, 0))
            for key in FILE_COUNTS:
                mine[key] += counts.get(key, 0)

    def count(self, path: str, *, records: int = 0, kept: list[Document] = ()) -> None:
        """Add to ``path``'s counts: records read and the documents kept of them."""
        added = (records, len(kept), sum(map(len, kept)), sum(map(trained_tokens, kept)))
        counts = self.files.setdefault(path, dict.fromkeys(FILE_COUNTS, 0))
        for key, value in zip(FILE_COUNTS, added, strict=True):
            counts[key] += value


#: what :attr:`LengthReport.files` counts per data file
FILE_COUNTS = ("records", "documents", "tokens", "trained_tokens")


def trained_tokens(doc: Document) -> int:
    """Tokens whose prediction carries loss: targets after the first token (nothing in a
    document predicts its first token)."""
    return int(doc.target[1:].sum())


def _slice(doc: Document, start: int, stop: int) -> Document:
    return Document(doc.tokens[start:stop], doc.target[start:stop])


def fit_document(doc: Document, report: LengthReport, *, where: str) -> list[Document]:
    """``doc`` as the ``long_documents`` policy has it (an empty list: dropped).

    ``"truncate"`` keeps ``seq_len`` tokens: the first token (BOS) and the last
    ``seq_len - 1`` when every trained token lies among them (a prompt's start is cut, the
    completion kept whole), else the first ``seq_len`` (the end is cut); a window left
    with no trained token is dropped. ``"split"`` cuts pieces of at most ``seq_len``
    (later pieces start without the earlier context) and drops (and counts) the pieces
    with no trained token; ``"drop"`` skips the document;
    ``"error"`` refuses it.
    """
    n, seq_len = len(doc), report.seq_len
    if n < 2:
        report.short += 1
        return []
    if n <= seq_len:
        return [doc]
    report.too_long += 1
    report.longest = max(report.longest, n)
    policy = report.policy
    if policy == "error":
        raise DataError(
            f"{where}: a document of {n} tokens is longer than seq_len({seq_len}); set [data] "
            'long_documents = "truncate", "split" or "drop", or a larger [train] seq_len'
        )
    if policy == "drop":
        return []
    if policy == "split":
        pieces = [_slice(doc, a, a + seq_len) for a in range(0, n, seq_len)]
        report.pieces += len(pieces)
        kept = [p for p in pieces if trained_tokens(p)]
        report.emptied += len(pieces) - len(kept)  # nothing to learn from: dropped, counted
        return kept
    trained = doc.target[1:].nonzero()
    first = int(trained[0]) + 1 if trained.numel() else n
    if n - first <= seq_len - 1:
        report.cut_start += 1
        kept = Document(
            torch.cat([doc.tokens[:1], doc.tokens[n - seq_len + 1 :]]),
            torch.cat([doc.target[:1], doc.target[n - seq_len + 1 :]]),
        )
    else:
        report.cut_end += 1
        kept = _slice(doc, 0, seq_len)
    if not trained_tokens(kept):
        report.emptied += 1
        return []
    return [kept]


# ----------------------------------------------------------------------------- sources
BATCH_RECORDS = 512  # records whose strings are tokenised in one call (spread over threads)
_TEXT_KEYS = ("text", "prompt", "completion")


class _Encoded:
    """``tokenizer`` with a batch of records' strings already encoded (one
    ``encode_batch`` call, which the ``tokenizers`` library runs on several threads)."""

    def __init__(self, tokenizer, texts: list[str]):
        self._tokenizer = tokenizer
        unique = list(dict.fromkeys(texts))
        self._ids = dict(zip(unique, tokenizer.encode_batch(unique), strict=True))

    def encode(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        return ids if ids is not None else self._tokenizer.encode(text)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _batches(records: Iterator) -> Iterator[tuple[list, DataError | None]]:
    """Records in lists of :data:`BATCH_RECORDS`; a file error ends the last list, and is
    raised after it, so the first bad line is the one reported."""
    batch = []
    try:
        for item in records:
            batch.append(item)
            if len(batch) == BATCH_RECORDS:
                yield batch, None
                batch = []
    except DataError as err:
        yield batch, err
        return
    if batch:
        yield batch, None


def iter_documents(paths: Sequence[Path], tokenizer, report: LengthReport) -> Iterator[Document]:
    """Every record of every file, tokenised, with ``report``'s ``long_documents`` policy
    applied (and counted in ``report``). Documents under 2 tokens are skipped."""
    chat = None
    for path in paths:
        for batch, error in _batches(jsonl_records(path, report)):
            texts = [
                r[k]
                for r, _ in batch
                if isinstance(r, dict)
                for k in _TEXT_KEYS
                if isinstance(r.get(k), str)
            ]
            encoder = _Encoded(tokenizer, texts) if texts else tokenizer
            for record, where in batch:
                is_chat = isinstance(record, dict) and record_format(record, where) == "messages"
                if chat is None and is_chat:
                    try:
                        chat = ChatRenderer(tokenizer)
                    except DataError as err:
                        raise DataError(f"{where}: {err}") from None
                doc = document_from_record(record, encoder, where=where, chat=chat)
                kept = fit_document(doc, report, where=where)
                report.count(str(path), records=1, kept=kept)
                yield from kept
            if error is not None:
                raise error


def read_jsonl(
    paths: Sequence[Path], tokenizer, *, seq_len: int | None = None, long_documents="truncate"
) -> tuple[list[Document], LengthReport]:
    """:func:`iter_documents` as a list, and its report (``seq_len=None``: no limit)."""
    report = LengthReport(long_documents, seq_len if seq_len is not None else 1 << 62)
    documents = list(iter_documents(paths, tokenizer, report))
    if not documents:
        raise DataError(f"no documents with at least 2 tokens in {', '.join(map(str, paths))}")
    return documents, report


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

"""The tokenised corpus: documents stored flat, and its memory-mapped cache on disk.

A :class:`Corpus` is three arrays: ``tokens`` int32 ``[N]``, ``target`` bool ``[N]``
and ``offsets`` int64 ``[D + 1]`` (document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``).
On disk the cache is one directory per key holding the three as raw little-endian files
(``tokens.i32``, ``target.u8``, ``offsets.i64``) and ``meta.json`` with their sizes and
checksums (:mod:`usp.train.checksums`), written to a temporary directory
``.tokens-KEY.HOST.PID`` and renamed into place (a reader never sees half a cache). The key
is a SHA-256 of the data files' contents, the tokenizer (its ``tokenizer.json`` bytes,
special tokens and chat template) and the options that change the documents
(``seq_len``, ``long_documents``), so a changed input is never served an old cache and an
unchanged one (a resume) is never tokenised twice. Ranks map the files
(``torch.from_file``, copy-on-write): a node's ranks share one copy in the page cache.

Before a cache is reused, :func:`cache_damage` checks it against its checksums (a cache
whose ids were permuted or overwritten still has the right size, and every id may be
in range); a damaged or incomplete one is removed and rebuilt with a note
(:func:`remove_damaged`), and :func:`remove_dead_temporaries` deletes the temporary
directories of builders on this host that died (``kill -9``) before renaming theirs.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from usp.errors import DataError
from usp.train.checksums import ALGORITHM, checksum_files, file_sha256, find_damage
from usp.train.data.records import Document, LengthReport, iter_documents

_FILES = {"tokens": ("tokens.i32", torch.int32), "target": ("target.u8", torch.bool)}
_RAW_FILES = ("tokens.i32", "target.u8", "offsets.i64")
# a builder's temporary directory: .tokens-KEY.HOST.PID (see CorpusBuilder.write)
_TEMPORARY = re.compile(r"^\.(tokens-[0-9a-f]+)\.(.+)\.(\d+)$")
# 2: "split" drops pieces without a trained token; 3: meta.json holds the files' checksums
# 4: the report counts blank JSONL lines
CACHE_VERSION = 4


class Corpus:
    """Documents stored flat (see the module doc); indexing gives a :class:`Document`
    whose tensors are views (int32 tokens when mapped from the cache)."""

    def __init__(self, tokens: torch.Tensor, target: torch.Tensor, offsets: torch.Tensor):
        if not (tokens.shape == target.shape and offsets.numel() >= 1):
            raise ValueError("tokens and target must have one entry per token")
        self.tokens, self.target, self.offsets = tokens, target, offsets

    @classmethod
    def from_documents(cls, documents: Sequence[Document]) -> Corpus:
        lengths = torch.tensor([len(d) for d in documents], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        if not documents:
            return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool), offsets)
        tokens = torch.cat([d.tokens.to(torch.int32) for d in documents])
        return cls(tokens, torch.cat([d.target for d in documents]), offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, index: int) -> Document:
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return Document(self.tokens[a:b], self.target[a:b])

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()


class CorpusBuilder:
    """Documents appended one by one, concatenated into flat arrays at the end."""

    def __init__(self):
        self._tokens: list[torch.Tensor] = []
        self._target: list[torch.Tensor] = []
        self._lengths: list[int] = []

    def add(self, doc: Document) -> None:
        self._tokens.append(doc.tokens.to(torch.int32))
        self._target.append(doc.target)
        self._lengths.append(len(doc))

    def __len__(self) -> int:
        return len(self._lengths)

    def corpus(self) -> Corpus:
        if not self._lengths:
            return Corpus.from_documents([])
        lengths = torch.tensor(self._lengths, dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return Corpus(torch.cat(self._tokens), torch.cat(self._target), offsets)

    def write(self, directory: Path, meta: dict) -> None:
        """The three arrays and ``meta.json`` into ``directory`` (which must not exist),
        through a temporary sibling renamed into place."""
        corpus = self.corpus()
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".{directory.name}.{socket.gethostname()}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, tensor in zip(_RAW_FILES, (corpus.tokens, corpus.target, corpus.offsets)):
            _write_raw(tmp / name, tensor)
        meta = {**meta, "documents": len(corpus), "tokens": corpus.num_tokens}
        meta["built_by"] = {"host": socket.gethostname(), "pid": os.getpid()}
        sums = checksum_files([tmp / name for name in _RAW_FILES], threads=torch.get_num_threads())
        meta["checksums"] = {"algorithm": ALGORITHM, "files": dict(zip(_RAW_FILES, sums))}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(tmp, directory)
        except OSError:  # another process on a shared file system finished first
            shutil.rmtree(tmp, ignore_errors=True)
            if not (directory / "meta.json").is_file():
                raise


def _write_raw(path: Path, tensor: torch.Tensor) -> None:
    """A tensor's elements as raw little-endian bytes (numpy when importable, else the
    standard library's ``array``)."""
    try:
        data = tensor.numpy()
        if sys.byteorder != "little":
            data = data.byteswap()
    except RuntimeError:  # torch without numpy
        codes = {torch.int32: "i", torch.int64: "q", torch.bool: "B"}
        data = array.array(
            codes[tensor.dtype],
            tensor.to(torch.uint8).tolist() if tensor.dtype == torch.bool else tensor.tolist(),
        )
        if sys.byteorder != "little":
            data.byteswap()
    with open(path, "wb") as f:
        data.tofile(f)


# ----------------------------------------------------------------------------- the cache
def cache_key(paths: Sequence[Path], tokenizer, options: dict) -> str:
    """What the cached documents depend on (see the module doc), as a hex digest."""
    digest = hashlib.sha256(f"usp-data-cache {CACHE_VERSION}\n".encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(f"\ntokenizer {tokenizer.fingerprint}\n".encode())
    for path in paths:
        digest.update(f"file {file_sha256(path)}\n".encode())
    return digest.hexdigest()


def cache_dir(root: Path, key: str) -> Path:
    return root / f"tokens-{key[:20]}"


def is_complete(directory: Path) -> bool:
    return (directory / "meta.json").is_file()


def cache_damage(directory: Path) -> str | None:
    """What is wrong with the cache ``directory`` that exists (None: it is complete and its
    files match the checksums in its ``meta.json``; hashes them with torch's thread count)."""
    if not directory.is_dir():
        return "not a directory"
    if not is_complete(directory):
        return "no meta.json: a crashed build, or damaged"
    try:
        meta = json.loads((directory / "meta.json").read_text())
        recorded = meta["checksums"]
        if recorded["algorithm"] != ALGORITHM:
            return f"checksums of another kind ({recorded['algorithm']!r})"
        files = recorded["files"]
        if sorted(files) != sorted(_RAW_FILES):
            return f"meta.json lists the files {sorted(files)}"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        return f"meta.json is not readable ({type(err).__name__}: {err})"
    return find_damage(directory, files, threads=torch.get_num_threads())


def remove_damaged(directory: Path, damage: str) -> str:
    """Delete a damaged cache; returns the note that says so (a DataError when it cannot
    be deleted)."""
    try:
        if directory.is_dir() and not directory.is_symlink():
            shutil.rmtree(directory)
        else:
            directory.unlink()
    except OSError as err:
        raise DataError(
            f"the tokenised data cache {directory} is damaged ({damage}) and cannot be "
            f"removed ({err.strerror or err}); delete it and start again (it is rebuilt "
            "from the data files)"
        ) from None
    return f"the tokenised data cache {directory} was damaged ({damage}): rebuilt from the data"


def remove_dead_temporaries(root: Path) -> list[str]:
    """Delete the temporary directories under ``root`` of builders on this host that are
    gone (a ``kill -9`` during a build); returns a note per directory removed. Another
    host's temporaries are left alone (nothing here can tell whether their builder
    lives)."""
    notes = []
    if not root.is_dir():
        return notes
    host = socket.gethostname()
    for path in sorted(root.iterdir()):
        match = _TEMPORARY.match(path.name)
        if not match or match.group(2) != host or _alive(int(match.group(3))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            notes.append(
                f"removed {path}, the temporary directory of a cache build that died "
                f"(pid {match.group(3)})"
            )
    return notes


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load_cache(directory: Path) -> tuple[Corpus, LengthReport, dict]:
    """Map a cache directory written by :meth:`CorpusBuilder.write`."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        n, d = int(meta["tokens"]), int(meta["documents"])
        arrays = {}
        for name, (file, dtype) in _FILES.items():
            arrays[name] = _map(directory / file, n, dtype)
        offsets = _map(directory / "offsets.i64", d + 1, torch.int64)
        report = LengthReport(**meta["report"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise DataError(
            f"the tokenised data cache {directory} is damaged ({err}); delete that directory "
            "and start again (it is rebuilt from the data files)"
        ) from None
    if int(offsets[-1]) != n:
        raise DataError(f"the tokenised data cache {directory} is damaged; delete it")
    return Corpus(arrays["tokens"], arrays["target"], offsets), report, meta


def _map(path: Path, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = path.stat().st_size
    expected = count * torch.empty(0, dtype=dtype).element_size()
    if size != expected:
        raise ValueError(f"{path.name} has {size} bytes, expected {expected}")
    if count == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.from_file(str(path), shared=False, size=count, dtype=dtype)


def tokenise(paths: Sequence[Path], tokenizer, report: LengthReport) -> CorpusBuilder:
    """The files' documents (see :func:`~usp.train.data.records.iter_documents`) in flat
    arrays; no documents at all is an error."""
    builder = CorpusBuilder()
    for doc in iter_documents(paths, tokenizer, report):
        builder.add(doc)
    if not len(builder):
        raise DataError(f"no documents with at least 2 tokens in {', '.join(map(str, paths))}")
    return builder


def build_cache(directory: Path, paths, tokenizer, report: LengthReport, key: str) -> None:
    """Tokenise the files into the cache ``directory`` (see :meth:`CorpusBuilder.write`)."""
    builder = tokenise(paths, tokenizer, report)
    meta = {"version": CACHE_VERSION, "key": key, "files": [str(p) for p in paths]}
    try:
        builder.write(directory, {**meta, "report": asdict(report)})
    except OSError as err:
        raise DataError(
            f"cannot write the tokenised data cache {directory}: {err}; the output directory "
            "must be writable"
        ) from None

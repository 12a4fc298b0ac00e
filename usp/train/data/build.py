"""Tokenise once: the corpus of a training run, built by one process and mapped by all.

In a distributed run rank 0 tokenises the data files into the cache (see
:mod:`usp.train.data.corpus`) unless a cache with the same key is already there (a
resume, or a rerun with the same data); a node that cannot see rank 0's cache
(node-local output directories) has its first local rank build its own copy, after
checking that its data files hash to the same key. Every rank then maps the cache.
Each stage ends in an agreement (:func:`usp.comm.agreement.agree`): a bad record found
by the builder is the same :class:`DataError` on every rank, and nothing hangs.

While the builder tokenises, the other ranks wait in that agreement's collective, so a
tokenisation that takes longer than the process group's timeout fails the run; rerunning
reuses whatever cache was completed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from usp.errors import DataError
from usp.train.data.corpus import (
    Corpus,
    build_cache,
    cache_dir,
    cache_key,
    is_complete,
    load_cache,
    tokenise,
)
from usp.train.data.records import LengthReport, fit_document, synthetic_documents


@dataclass(frozen=True)
class DataInputs:
    """What ``[data]`` reads, checked (files found, tokenizer loaded); nothing tokenised.

    ``files`` is empty for the synthetic source, whose ``synthetic`` holds
    ``(count, length, seed)``."""

    tokenizer: object
    files: tuple[Path, ...]
    seq_len: int
    long_documents: str
    document_multiple: int
    seed: int
    shuffle: bool
    synthetic: tuple[int, int, int] | None = None

    def key(self) -> str:
        options = {"seq_len": self.seq_len, "long_documents": self.long_documents}
        return cache_key(self.files, self.tokenizer, options)


@dataclass
class Built:
    corpus: Corpus
    report: LengthReport
    notes: list[str]
    key: str | None  # the cache key (None: synthetic or in memory)


def build_corpus(inputs: DataInputs, *, topology=None, cache_root: Path | None = None) -> Built:
    """The run's documents: generated, tokenised in memory (``cache_root=None``), or
    tokenised once into ``cache_root`` and mapped (every rank of ``topology`` must call)."""
    report = LengthReport(inputs.long_documents, inputs.seq_len)
    if inputs.synthetic is not None:
        count, length, seed = inputs.synthetic
        docs = synthetic_documents(count, length=length, seed=seed)
        kept = [d for doc in docs for d in fit_document(doc, report, where="synthetic")]
        if not kept:
            raise DataError("no synthetic document is left after [data] long_documents")
        return Built(Corpus.from_documents(kept), report, [report.describe()], None)
    if cache_root is None:
        corpus = tokenise(inputs.files, inputs.tokenizer, report).corpus()
        return Built(corpus, report, [report.describe()], None)
    if topology is None:
        return _single(inputs, cache_root)
    return _distributed(inputs, cache_root, topology)


def _build(inputs: DataInputs, directory: Path, key: str) -> float:
    started = time.perf_counter()
    build_cache(
        directory,
        inputs.files,
        inputs.tokenizer,
        LengthReport(inputs.long_documents, inputs.seq_len),
        key,
    )
    return time.perf_counter() - started


def _notes(report: LengthReport, directory: Path, seconds: float | None) -> list[str]:
    how = (
        f"tokenised into {directory} in {seconds:.1f} s"
        if seconds is not None
        else f"tokenised data reused from {directory}"
    )
    return [report.describe(), how]


def _single(inputs: DataInputs, root: Path) -> Built:
    key = inputs.key()
    directory = cache_dir(root, key)
    seconds = None if is_complete(directory) else _build(inputs, directory, key)
    corpus, report, _ = load_cache(directory)
    return Built(corpus, report, _notes(report, directory, seconds), key)


def _distributed(inputs: DataInputs, root: Path, topology) -> Built:
    import torch.distributed as dist

    from usp.comm.agreement import agree

    group, rank = dist.group.WORLD, dist.get_rank()

    def stage(what: str, work) -> None:
        error = None
        try:
            work()
        except Exception as err:  # noqa: BLE001 - every rank must reach the agreement
            error = err
        agree(group, what, [], error, (DataError,))

    found: dict = {"key": None, "seconds": None}

    def on_rank0() -> None:
        if rank == 0:
            found["key"] = inputs.key()
            directory = cache_dir(root, found["key"])
            if not is_complete(directory):
                found["seconds"] = _build(inputs, directory, found["key"])

    stage("tokenising the training data on rank 0", on_rank0)
    box = [(found["key"], found["seconds"])]
    dist.broadcast_object_list(box, src=0)
    key, seconds = box[0]
    directory = cache_dir(root, key)

    def on_other_nodes() -> None:
        if rank != 0 and topology.local_rank == 0 and not is_complete(directory):
            mine = inputs.key()
            if mine != key:
                raise DataError(
                    f"the data files or tokenizer on node {topology.node} differ from rank "
                    f"0's (tokenised-data key {mine[:20]} against {key[:20]}); every node must "
                    "read the same files"
                )
            _build(inputs, directory, key)

    stage("tokenising the training data on nodes without rank 0's cache", on_other_nodes)
    mapped: dict = {}

    def on_every_rank() -> None:
        mapped["value"] = load_cache(directory)

    stage("mapping the tokenised training data", on_every_rank)
    corpus, report, _ = mapped["value"]
    return Built(corpus, report, _notes(report, directory, seconds), key)


def describe_files(files: Sequence[Path]) -> str:
    if len(files) <= 3:
        return ", ".join(map(str, files))
    return f"{len(files)} files ({files[0]} ... {files[-1]})"

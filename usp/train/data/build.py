"""Tokenise once: the corpus of a training run, built by one process and mapped by all.

In a distributed run rank 0 tokenises the data files into the cache (see
:mod:`usp.train.data.corpus`) unless a cache with the same key is already there (a
resume, or a rerun with the same data); a node that cannot see rank 0's cache
(node-local output directories) has its first local rank build its own copy, after
checking that its data files hash to the same key. Every rank then maps the cache.
The process that would build a node's cache checks an existing one against its
checksums first (:func:`usp.train.data.corpus.cache_damage`) and rebuilds a damaged one
with a note; it also removes the temporaries of builders on its host that died. Each
stage ends in an agreement (:func:`usp.comm.agreement.agree`): a bad record found by the
builder is the same :class:`DataError` on every rank, and nothing hangs.

While the builder tokenises, the other ranks wait in that agreement's collective, so a
tokenisation that takes longer than the process group's timeout fails the run; rerunning
reuses whatever cache was completed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from usp.comm.agreement import agree
from usp.errors import DataError
from usp.process_groups import as_topology
from usp.train.checksums import file_sha256
from usp.train.data.corpus import (
    Corpus,
    build_cache,
    cache_damage,
    cache_dir,
    cache_key,
    load_cache,
    remove_damaged,
    remove_dead_temporaries,
    tokenise,
)
from usp.train.data.packing import PackedDataset
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
    if as_topology(topology).single_process:
        return _single(inputs, cache_root)
    return _distributed(inputs, cache_root, topology)


def packed_dataset(
    inputs: DataInputs, *, shuffle: bool, topology=None, cache_root: Path | None = None
) -> tuple[Built, PackedDataset]:
    """:func:`build_corpus`, packed into rows of ``inputs.seq_len`` (``shuffle``: the
    seeded order of each epoch; False: file order, as the held-out set is read)."""
    built = build_corpus(inputs, topology=topology, cache_root=cache_root)
    dataset = PackedDataset(
        built.corpus,
        seq_len=inputs.seq_len,
        document_multiple=inputs.document_multiple,
        pad_id=inputs.tokenizer.pad_id,
        seed=inputs.seed,
        shuffle=shuffle,
    )
    return built, dataset


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


def _ensure(inputs: DataInputs, root: Path, key: str) -> tuple[float | None, list[str]]:
    """Make the cache of ``key`` under ``root`` usable: reuse it when it matches its
    checksums, else (absent, damaged, half-written) build it. Returns the build's seconds
    (None: reused) and the notes about what was repaired."""
    notes = remove_dead_temporaries(root)
    directory = cache_dir(root, key)
    if os.path.lexists(directory):
        damage = cache_damage(directory)
        if damage is None:
            return None, notes
        notes.append(remove_damaged(directory, damage))
    return _build(inputs, directory, key), notes


def _meta_digest(root: Path, key: str | None) -> str | None:
    """The SHA-256 of the cache's ``meta.json`` (which holds its files' checksums and its
    builder's host and pid): equal on two nodes when they see the same cache."""
    path = None if key is None else cache_dir(root, key) / "meta.json"
    try:
        return None if path is None else file_sha256(path)
    except OSError:
        return None


def _notes(report: LengthReport, directory: Path, seconds: float | None) -> list[str]:
    how = (
        f"tokenised into {directory} in {seconds:.1f} s"
        if seconds is not None
        else f"tokenised data reused from {directory} (checksums verified)"
    )
    return [report.describe(), how]


def _single(inputs: DataInputs, root: Path) -> Built:
    key = inputs.key()
    directory = cache_dir(root, key)
    seconds, repaired = _ensure(inputs, root, key)
    corpus, report, _ = load_cache(directory)
    return Built(corpus, report, [*repaired, *_notes(report, directory, seconds)], key)


def _distributed(inputs: DataInputs, root: Path, topology) -> Built:
    group, rank = dist.group.WORLD, dist.get_rank()

    def stage(what: str, work) -> None:
        error = None
        try:
            work()
        except Exception as err:  # noqa: BLE001 - every rank must reach the agreement
            error = err
        agree(group, what, [], error, (DataError,))

    found: dict = {"key": None, "seconds": None, "notes": []}

    def on_rank0() -> None:
        if rank == 0:
            found["key"] = inputs.key()
            found["seconds"], found["notes"] = _ensure(inputs, root, found["key"])

    stage("tokenising the training data on rank 0", on_rank0)
    box = [(found["key"], found["seconds"], _meta_digest(root, found["key"]))]
    dist.broadcast_object_list(box, src=0)
    key, seconds, rank0_meta = box[0]
    directory = cache_dir(root, key)

    def on_other_nodes() -> None:
        # the first rank of every other node checks the cache its node sees (rank 0's on
        # shared storage, its own on node-local storage) and builds or repairs it
        if rank == 0 or topology.local_rank != 0:
            return
        if _meta_digest(root, key) == rank0_meta:  # the very cache rank 0 just verified
            return
        if os.path.lexists(directory) and cache_damage(directory) is None:
            found["notes"] = remove_dead_temporaries(root)
            return
        mine = inputs.key()
        if mine != key:
            raise DataError(
                f"the data files or tokenizer on node {topology.node} differ from rank "
                f"0's (tokenised-data key {mine[:20]} against {key[:20]}); every node must "
                "read the same files"
            )
        _, found["notes"] = _ensure(inputs, root, key)

    stage("tokenising the training data on nodes without rank 0's cache", on_other_nodes)
    every_notes: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_notes, found["notes"])  # rank 0 reports every node's repairs
    repaired = [note for notes in every_notes for note in notes]
    mapped: dict = {}

    def on_every_rank() -> None:
        mapped["value"] = load_cache(directory)

    stage("mapping the tokenised training data", on_every_rank)
    corpus, report, _ = mapped["value"]
    return Built(corpus, report, [*repaired, *_notes(report, directory, seconds)], key)


def describe_files(files: Sequence[Path]) -> str:
    if len(files) <= 3:
        return ", ".join(map(str, files))
    return f"{len(files)} files ({files[0]} ... {files[-1]})"

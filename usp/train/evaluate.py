"""The held-out loss of ``[eval]``, computed during training under sequence parallelism.

What is evaluated: the documents of ``[eval] files``, read by the training data's own
pipeline (the same tokenizer, ``long_documents`` policy, ``document_multiple`` and
``seq_len``; tokenised once into ``OUTPUT/cache`` like the training data, see
:mod:`usp.train.data.build`) and packed in file order (not shuffled), one epoch: every
document once. ``max_batches`` keeps the first N batches of ``global_batch`` sequences.

How (:func:`evaluate`, forward only): batch ``b`` covers eval sequences ``[b*G,
(b+1)*G)``; replica ``d`` takes the ``d``-th contiguous share of it in micro-batches of
``micro_batch`` sequences, as the training loader splits a step. Each micro-batch is
packed and sharded by the plan, and the model returns the SP-reduced sum of its label
losses divided by ``N``, the label count of the whole eval set (``num_items_in_batch``):
summed over micro-batches and replicas that is the mean loss over every label of the
eval set, what one process computes. Every rank runs the same number of forwards (FSDP
gathers parameters over the whole ``dp x sp`` mesh): a replica whose share of the last
batch is empty runs a row of padding, which has no label.

What it leaves alone: the training loader's position and data order, every RNG (no
dropout, no sampling), the optimizer and the gradients (none are computed). A run with
``[eval]`` trains exactly as one without, and a resumed run repeats its evaluations.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from usp.process_groups import as_topology
from usp.train.data import (
    DataError,
    MicroBatch,
    PackedDataset,
    PackedRow,
    micro_batch_of,
    resolve_files,
)
from usp.train.data.build import DataInputs, describe_files, packed_dataset


@dataclass(frozen=True)
class HeldOut:
    """The eval set of one dp replica: which packed sequences it evaluates, and ``N``."""

    dataset: PackedDataset  # the [eval] documents packed in file order
    sequences: int  # packed sequences evaluated (all replicas together)
    num_labels: int  # N: label tokens of those sequences (every replica's)
    global_batch: int
    micro_batch: int
    dp_degree: int
    dp_rank: int
    notes: tuple[str, ...] = ()  # what reading the files did (the start-up report)

    def micro_batches(self) -> Iterator[MicroBatch]:
        """This replica's micro-batches, as many on every replica (a padding row where a
        replica's share of the last batch ran out); a micro-batch no replica has data
        for is left out everywhere."""
        per_replica = self.global_batch // self.dp_degree
        for start in range(0, self.sequences, self.global_batch):
            for offset in range(0, per_replica, self.micro_batch):
                first = start + offset  # replica r's micro-batch begins r * per_replica later
                if not any(self._share(first + r * per_replica) for r in range(self.dp_degree)):
                    continue
                mine = self._share(first + self.dp_rank * per_replica)
                rows = [self.dataset.sequence(i) for i in mine] or [self._padding_row()]
                yield micro_batch_of(rows)  # the loader's own concatenation and shift

    def _share(self, first: int) -> range:
        """The eval sequences of the micro-batch that begins at ``first`` (maybe none)."""
        return range(first, min(first + self.micro_batch, self.sequences))

    def _padding_row(self) -> PackedRow:
        n = self.dataset.seq_len
        tokens = torch.full((n,), self.dataset.pad_id, dtype=torch.int64)
        return PackedRow(tokens, torch.zeros(n, dtype=torch.bool), (n,))

    def summary(self, every: int) -> list[str]:
        """Start-up lines: what is evaluated, how often, and what reading it did."""
        docs = len(self.dataset.documents)
        return [
            f"{docs} held-out documents, {self.sequences} sequences of {self.dataset.seq_len} "
            f"tokens, {self.num_labels} label tokens; evaluated every {every} steps and after "
            "the last",
            *self.notes,
        ]


def perplexity(loss: float) -> float:
    """``exp(loss)`` (inf where it overflows; NaN stays NaN)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean over every label token of the eval set
    num_labels: int
    sequences: int
    seconds: float

    def row(self, step: int) -> dict:
        """The ``metrics.jsonl`` row of an evaluation after optimizer step ``step``."""
        return {
            "step": step,
            "eval_loss": self.loss,
            "eval_perplexity": perplexity(self.loss),
            "eval_tokens": self.num_labels,
            "eval_sequences": self.sequences,
            "eval_time_s": self.seconds,
        }


# ----------------------------------------------------------------------------- set-up
def prepare_held_out(job, train_inputs: DataInputs) -> DataInputs | None:
    """``[eval]`` checked without tokenising anything (the files exist; every rank can
    run it alone, in the trainer's set-up): the training data's inputs with the eval
    files, unshuffled. None without ``[eval]``."""
    if job.eval is None:
        return None
    try:
        files = tuple(resolve_held_out(job.eval.files, job.config_dir, "[eval] files"))
    except DataError as err:
        raise job.error(str(err), type(err)) from None
    return dataclasses.replace(train_inputs, files=files, shuffle=False, synthetic=None)


def resolve_held_out(patterns, base: Path, key: str) -> list[Path]:
    """Held-out files as :func:`usp.train.data.resolve_files` finds them, with errors
    that name ``key`` (``[eval] files``, ``--data``) rather than ``[data] files``."""
    try:
        return resolve_files(patterns, base, key=key)
    except DataError as err:
        text = str(err)
        raise DataError(text if text.startswith(key) else f"{key}: {text}") from None


def overlap_note(inputs: DataInputs, train_inputs: DataInputs) -> str | None:
    """A note naming the eval files that are also training files, if any."""
    trained = {Path(f).resolve() for f in train_inputs.files}
    shared = [f for f in inputs.files if Path(f).resolve() in trained]
    if not shared:
        return None
    return (
        f"note: [eval] files {', '.join(map(str, shared))} are also [data] files: the model "
        "trains on them, so their eval loss is not a held-out loss"
    )


def load_held_out(
    job,
    inputs: DataInputs | None,
    train_inputs: DataInputs,
    *,
    topology=None,
    cache_root: Path | None = None,
) -> HeldOut | None:
    """The eval set of :func:`prepare_held_out`'s ``inputs`` (None: none), tokenised once
    into ``cache_root`` (a collective when ``topology`` is given: every rank calls it) and
    packed; ``N`` counted from the data on every rank without communication."""
    if inputs is None:
        return None
    try:
        built, dataset = packed_dataset(
            inputs, shuffle=False, topology=topology, cache_root=cache_root
        )
    except DataError as err:
        raise job.error(f"[eval] files: {err}") from None
    t = job.train
    sequences = dataset.sequences_in_epoch(0)
    if job.eval.max_batches is not None:
        sequences = min(sequences, job.eval.max_batches * t.global_batch)
    num_labels = sum(micro_batch_of([dataset.sequence(i)]).num_labels for i in range(sequences))
    if num_labels == 0:
        raise job.error(
            f"[eval] files ({describe_files(inputs.files)}): the evaluated sequences have no "
            "label token (every token is a prompt or padding); give documents with trained "
            "tokens (text, a completion, assistant turns)"
        )
    topology = as_topology(topology)
    dp = topology.dp_degree
    return HeldOut(
        dataset,
        sequences,
        num_labels,
        global_batch=t.global_batch,
        micro_batch=t.micro_batch,
        dp_degree=dp,
        dp_rank=topology.dp_rank,
        notes=tuple(
            note
            for note in (
                f"from {describe_files(inputs.files)}",
                *built.notes,
                overlap_note(inputs, train_inputs),
            )
            if note
        ),  # fmt: skip
    )


# ----------------------------------------------------------------------------- evaluation
def evaluate(model, plan, held_out: HeldOut, device: torch.device) -> EvalResult:
    """The mean loss over every label of the eval set (module docstring), forward only.
    A collective: every rank of the plan's topology calls it. The value is the same on
    every rank (summed from all-reduced numbers)."""
    started = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=device)  # on the device: no sync
    with torch.no_grad():
        for micro in held_out.micro_batches():
            packed = plan.pack(micro.cu_seqlens, device=device)
            input_ids = plan.shard(micro.input_ids, packed=packed).to(device)  # [1, S/P]
            labels = plan.shard(micro.labels, packed=packed).to(device)
            loss = model(
                input_ids, labels=labels, cu_seqlens=packed, num_items_in_batch=held_out.num_labels
            )
            total += loss.to(torch.float64)
    topology = plan.topology
    if topology.dp_degree > 1:
        # every SP rank of a replica holds the replica's part; the replicas' parts add up
        dist.all_reduce(total, group=topology.dp_group)
    loss = float(total)
    seconds = time.perf_counter() - started
    return EvalResult(loss, held_out.num_labels, held_out.sequences, seconds)

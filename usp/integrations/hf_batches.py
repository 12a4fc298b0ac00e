"""What a transformers data collator gives, as usp's global batch and this rank's shard.

A collator's batch is one of three kinds, all trained exactly:

* **padding-free** (``DataCollatorWithFlattening``, TRL's ``padding_free=True``):
  ``input_ids [1, T]`` with the documents as ``cu_seq_lens_q/k`` or ``position_ids`` that
  restart per document: the documents, as they are;
* **rows with right padding** (``DataCollatorForLanguageModeling``, ``DataCollatorWithPadding``):
  every row's real tokens become one document of a packed sequence (exactly what the
  padded batch computes: a causal row never attends to its pads); left padding is
  refused (its positions would differ);
* **dense rows** (equal lengths, no padding): sharded as they are when the plan can place
  their length, else packed as documents too.

A vision-language batch (TRL's vision collator: padded rows with a processor's outputs)
becomes documents or dense rows the same way, its token types packed with the tokens, and
is sharded by :func:`usp.models.hf.shard_multimodal` (:attr:`GlobalBatch.media`).

:class:`GlobalBatch` is that batch before sharding: its label count
(:meth:`GlobalBatch.label_count`) is what the step's loss is normalised by, and
:meth:`GlobalBatch.shard` is this rank's part (documents padded to the layout, labels
shifted on the global sequence, the SP ranks agreeing on the batch's fingerprint:
:func:`usp.models.shard_batch`). :class:`DataParallelSampler` gives every SP rank of a
replica the same samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

import usp.models.hf as usp_hf
from usp.models import IGNORE_INDEX, ShardedBatch, shard_batch, shift_labels
from usp.models.hf_inputs import HFInputError
from usp.models.hf_multimodal_checks import multimodal_inputs
from usp.sp.plan import Plan
from usp.sp.sharding import pad_documents


@dataclass(frozen=True)
class GlobalBatch:
    """One micro-batch of a dp replica before sharding: ``input_ids`` [B, S] (B = 1 when
    packed), ``labels`` aligned with the tokens (HF's convention, unshifted; ``-100``
    where there is no target), ``cu_seqlens`` the int32 document boundaries of a packed
    row (None: dense rows)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None
    #: a vision-language model's processor outputs (pixels, grids; token types aligned
    #: with ``input_ids``), placed by :func:`usp.models.hf.shard_multimodal`; None: text
    media: dict | None = None

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def shifted_labels(self) -> torch.Tensor:
        """The next-token targets of the global batch (per document when packed)."""
        return shift_labels(self.labels, cu_seqlens=self.cu_seqlens)

    def label_count(self) -> int:
        """Tokens that have a target: the loss's denominator (one host sync)."""
        return int((self.shifted_labels() != IGNORE_INDEX).sum())

    def longest_sequence(self) -> int:
        """The global length attention spans (the packed row's, or a row's)."""
        return self.input_ids.shape[1]

    def shard(self, plan: Plan, *, pad_token_id: int = 0, model=None) -> ShardedBatch:
        """This rank's part; collective over the SP group (see the module docstring).
        ``model``: the vision-language model a batch with media is for."""
        if self.media is not None:
            return self._shard_media(plan, pad_token_id, model)
        if self.cu_seqlens is None:
            return shard_batch(plan, self.input_ids, labels=self.labels)
        flattened = {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "cu_seq_lens_q": self.cu_seqlens,
        }
        return usp_hf.shard_flattened(plan, flattened, pad_token_id=pad_token_id)

    def _shard_media(self, plan: Plan, pad_token_id: int, model) -> ShardedBatch:
        """:func:`usp.models.hf.shard_multimodal` of the batch, its documents (if packed)
        padded to the layout first (pads: ``pad_token_id``, ignored labels, text type)."""
        if model is None:
            raise ValueError("a batch with media is sharded for its model: shard(plan, model=...)")
        ids, labels, cu, media = self.input_ids, self.labels, self.cu_seqlens, dict(self.media)
        real = None
        if cu is not None:
            padding = pad_documents(cu, plan)
            for key, value in media.items():
                if value.shape == ids.shape:  # a per-token input: text type at the pads
                    media[key] = padding.apply(value, 0)
            real = padding.apply(torch.ones_like(ids, dtype=torch.bool), False)  # [1, S']
            ids, labels = padding.apply(ids, pad_token_id), padding.apply(labels, IGNORE_INDEX)
            cu = padding.cu_seqlens
        batch = usp_hf.shard_multimodal(plan, model, ids, labels=labels, cu_seqlens=cu, **media)
        if real is None:
            return batch
        real = plan.shard(real, packed=batch.packed).to(batch.input_ids.device)
        return dataclasses.replace(batch, real=real)


def global_batch(inputs: Mapping, plan: Plan) -> GlobalBatch:
    """The :class:`GlobalBatch` of a collator's output (see the module docstring);
    an :class:`usp.models.hf_inputs.HFInputError` for what cannot be trained exactly."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise HFInputError(
            "usp's Trainer integration needs batches with integer input_ids [B, S] (a causal "
            f"LM's collator), got {type(ids).__name__}"
            + (f" of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else "")
        )
    labels = inputs.get("labels")
    labels = ids if labels is None else labels
    if labels.shape != ids.shape:
        raise HFInputError(
            f"labels of shape {tuple(labels.shape)} do not match input_ids {tuple(ids.shape)}"
        )
    media = {key: inputs[key] for key in multimodal_inputs(inputs)}
    if media:
        return _media_batch(inputs, plan, ids, labels, media)
    if _padding_free(inputs):
        cu = usp_hf.flattened_boundaries(inputs, ids.shape[1])
        return GlobalBatch(ids, labels, cu)
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        return _rows_as_documents(ids, labels, mask.bool())
    if ids.shape[1] % plan.sequence_multiple == 0:
        return GlobalBatch(ids, labels, None)
    return _rows_as_documents(ids, labels, torch.ones_like(ids, dtype=torch.bool))


def _media_batch(inputs: Mapping, plan: Plan, ids, labels, media: dict) -> GlobalBatch:
    """A vision-language batch (TRL pads its rows on the right): dense rows when they fit
    the layout, else every row's real tokens one document, token types with them."""
    if _padding_free(inputs):
        raise HFInputError(
            "a padding-free batch with images: usp places a vision-language batch from padded "
            "rows (TRL's vision collator; padding_free=False)"
        )
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if bool(mask.all()) and ids.shape[1] % plan.sequence_multiple == 0:
        return GlobalBatch(ids, labels, None, media)
    rows = _rows_as_documents(ids, labels, mask)
    keep = mask.reshape(-1)
    for key, value in media.items():
        if value.shape == ids.shape:  # a per-token input (token types): packed with them
            media[key] = value.reshape(-1)[keep][None]
    return dataclasses.replace(rows, media=media)


def _padding_free(inputs: Mapping) -> bool:
    if any(inputs.get(k) is not None for k in usp_hf.CU_KWARGS):
        return True
    positions = inputs.get("position_ids")
    if positions is None or positions.shape[0] != 1 or positions.shape[-1] < 2:
        return False
    return bool((torch.diff(positions.reshape(-1)) != 1).any())


def _rows_as_documents(ids, labels, mask) -> GlobalBatch:
    """Every row's real tokens as one document of a packed row [1, T]."""
    later_token = mask[:, 1:] & ~mask[:, :-1]  # a real token after a pad
    if bool(later_token.any()):
        row = int(later_token.any(dim=1).nonzero()[0])
        raise HFInputError(
            f"row {row} of the batch has padding before real tokens (left padding or holes): "
            "its tokens' positions would not count from 0; pad on the right (the tokenizer's "
            "padding_side='right') or use a padding-free collator"
        )
    lengths = mask.sum(dim=1)
    keep = mask.reshape(-1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0).to("cpu", torch.int32)
    packed_ids = ids.reshape(-1)[keep][None]  # [1, T]
    packed_labels = labels.reshape(-1)[keep][None]
    return GlobalBatch(packed_ids, packed_labels, cu)


# ----------------------------------------------------------------------------- sampling
class DataParallelSampler(Sampler[int]):
    """The sample indices of one data-parallel replica.

    Each epoch's order (the data set's, or a permutation drawn from ``seed + epoch``) is
    cut into global batches of ``batch_size * dp_degree`` samples; replica ``d`` takes
    the ``d``-th ``batch_size`` of each. The global batches do not depend on the degrees:
    one process with ``batch_size * dp_degree`` sees the same ones, and every SP rank of
    a replica the same samples. An epoch that does not fill its last global batch is
    completed from its own start (as accelerate's ``even_batches`` does), so every
    replica runs the same number of micro-batches; ``drop_last``: that batch is left out
    instead (``dataloader_drop_last``)."""

    def __init__(
        self,
        length: int,
        *,
        batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if length < 1:
            raise ValueError("the training data set is empty")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        self.length, self.batch_size = length, batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if drop_last and length < self.global_batch:
            raise ValueError(
                f"dataloader_drop_last with {length} samples and a global batch of "
                f"{self.global_batch} (batch {batch_size} x {dp_degree} replicas) leaves nothing"
            )
        self.epoch = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_degree

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return rounding(self.length / self.global_batch)

    def __len__(self) -> int:
        return self._batches() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        total = self._batches() * self.global_batch
        while len(order) < total:  # complete the last global batch from the start
            order += order[: total - len(order)]
        first = self.dp_rank * self.batch_size
        for start in range(0, total, self.global_batch):
            yield from order[start + first : start + first + self.batch_size]

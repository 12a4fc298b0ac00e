"""A batch of scored rows (prompt + completion, chosen + rejected ...) under sequence
parallelism: the rows packed as documents, this rank's shard of them, and the way back
from per-token values on the shard to per-row values on every rank.

A post-training batch is ``B`` rows of a padded ``[B, S]`` tensor: each row's real
tokens (``attention_mask`` 1; one contiguous run: left padding, right padding or both)
and the tokens that are scored (``labels``, HF's convention: a token's label is the
token itself, ``-100`` where it is not scored, e.g. the prompt). :func:`shard_rows`
packs every row's real tokens as one document of a packed row (positions restart at 0
per row, which is what a causal model computes for a padded row up to RoPE's relative
invariance), pads the documents to the plan's layout, shifts the labels per document on
the global sequence and shards everything (:func:`usp.models.shard_batch`: the SP ranks
agree on the batch). Nothing of a row's padding is computed.

The *row layout* is TRL's: a ``[B, S - 1]`` tensor whose column ``t`` holds the value of
the prediction made at column ``t`` of the padded row (of the token at ``t + 1``), as
``logits[:, :-1]`` against ``labels[:, 1:]`` gives it. :meth:`RowShard.to_rows` brings
per-token values of this rank's shard there and :meth:`RowShard.sequence_sums` sums them
per row; both sum over the SP group with this contract:

* the **value** is the global one (every token's value, whichever rank computed it),
  the same bits on every SP rank;
* its **gradient** flows back to this rank's tokens only, so that the SP ranks, each
  computing the same function of the global values, produce gradients whose sum over
  the SP group is the single-process gradient (FSDP2 over ``dp x sp`` with summed
  gradients sums them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.errors import InputError
from usp.models.batch import ShardedBatch, shard_batch
from usp.models.labels import IGNORE_INDEX, shift_labels
from usp.sp.plan import as_plan
from usp.sp.sharding import pad_documents


class _SumOverGroup(torch.autograd.Function):
    """``all_reduce(SUM)`` forward; the gradient passes through unchanged (see the
    module docstring: every rank computes the same function of the sum)."""

    @staticmethod
    def forward(ctx, local, group):
        total = local.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(local: torch.Tensor, group=None) -> torch.Tensor:
    """``local`` summed over ``group`` (None: one process), with the gradient of the
    module docstring. Booleans are summed as integers and come back as booleans (an
    any), integers as integers."""
    if local.dtype == torch.bool:
        return sum_over_group(local.to(torch.int32), group) > 0
    if not local.is_floating_point():
        total = local.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total
    return _SumOverGroup.apply(local, group)


@dataclass(frozen=True)
class RowShard:
    """This rank's part of a batch of ``rows`` rows of ``columns + 1`` tokens
    (:func:`shard_rows`). ``batch``: the sharded packed row (``.hf_kwargs()`` is what the
    model takes; ``.labels`` the targets [1, S'/P] of this rank's positions, ``-100``
    where none; ``.real`` False at the pads that place documents on the layout).
    ``index`` [1, S'/P] int64: each position's flat index ``row * columns + column`` in
    the row layout, ``-1`` where the position has no target."""

    batch: ShardedBatch
    index: torch.Tensor
    rows: int
    columns: int
    group: object = None

    @property
    def targets(self) -> torch.Tensor:
        return self.batch.labels

    @property
    def row(self) -> torch.Tensor:
        """[1, S'/P] int64: the row of each position with a target, ``-1`` elsewhere."""
        return torch.where(self.index >= 0, self.index.div(self.columns, rounding_mode="floor"), -1)

    def to_rows(self, values: torch.Tensor, *, last: int | None = None) -> torch.Tensor:
        """values [1, S'/P] (this rank's per-token values) -> the row layout
        [rows, columns] on every SP rank, zeros where no token has a target (module
        docstring's contract). ``last``: only the last ``last`` columns (TRL's
        ``logits_to_keep``: the completion's)."""
        valid = self.index >= 0
        flat = torch.zeros(self.rows * self.columns, dtype=values.dtype, device=values.device)
        flat = flat.index_add(0, self.index[valid], values[valid])  # [rows * columns]
        full = sum_over_group(flat, self.group).view(self.rows, self.columns)
        kept = full if last is None else full[:, self.columns - last :]
        # a tensor of its own, not a view (one value per token: a small copy): a model
        # output under FSDP2 carries the pre-backward hook that an in-place op on a view
        # would drop (torch 2.13 warns of it on every such output)
        return kept.clone()

    def take(self, row_values: torch.Tensor, *, fill=0) -> torch.Tensor:
        """The inverse direction: row_values [rows, columns] (or its last ``c`` columns,
        [rows, c]) -> [1, S'/P], each position's value (``fill`` where it has no target
        or its column is not among the given ones). Local: no communication."""
        if row_values.dim() != 2 or row_values.shape[0] != self.rows:
            raise InputError(
                f"need [rows={self.rows}, columns] values, got {tuple(row_values.shape)}"
            )
        given = row_values.shape[1]
        if given > self.columns:
            raise InputError(f"{given} columns given, the rows have {self.columns}")
        first = self.columns - given  # the given ones are the last columns
        column = self.index.remainder(self.columns) - first
        keep = (self.index >= 0) & (column >= 0)
        flat = (self.row.clamp(min=0) * given + column.clamp(min=0)).to(row_values.device)
        taken = row_values.reshape(-1)[flat.reshape(-1)].view(self.index.shape)
        fill = torch.as_tensor(fill, dtype=row_values.dtype, device=row_values.device)
        return torch.where(keep.to(row_values.device), taken, fill)

    def sequence_sums(self, values: torch.Tensor) -> torch.Tensor:
        """values [1, S'/P] -> [rows]: each row's sum over its tokens on every SP rank
        (the module docstring's contract)."""
        valid = self.index >= 0
        sums = torch.zeros(self.rows, dtype=values.dtype, device=values.device)
        sums = sums.index_add(0, self.row[valid], values[valid])
        return sum_over_group(sums, self.group)


def row_spans(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first real column, real length) of every row of a [B, S] mask; an
    :class:`usp.errors.InputError` for a row without tokens or with a hole (a pad
    between real tokens)."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)  # [B]
    starts = mask.int().argmax(1)  # [B], the first 1
    columns = torch.arange(mask.shape[1], device=mask.device)
    run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0])
        raise InputError(f"row {row} of the batch has no tokens (its attention_mask is all 0)")
    if not bool(torch.equal(run, mask)):
        row = int((run != mask).any(1).nonzero()[0])
        raise InputError(
            f"row {row} of the batch has padding between its real tokens: a row's tokens "
            "must be one run (left and/or right padding only)"
        )
    return starts, lengths


def shard_rows(
    plan,
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> RowShard:
    """This rank's :class:`RowShard` of ``input_ids`` [B, S] with ``labels`` [B, S]
    (module docstring; labels outside the real tokens are never scored) and
    ``attention_mask`` [B, S] (None: every token is real). Collective over the SP
    group: every SP rank calls it with the same batch."""
    plan = as_plan(plan)
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise InputError(
            f"need input_ids and labels [B, S], got {tuple(input_ids.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise InputError(f"rows of {input_ids.shape[1]} token score nothing: need S >= 2")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise InputError(
            f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
            f"{tuple(input_ids.shape)}"
        )
    rows, width = input_ids.shape
    columns = width - 1
    starts, lengths = row_spans(attention_mask)
    mask = attention_mask.bool()
    cu = torch.zeros(rows + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0).to("cpu", torch.int32)
    packed_ids = input_ids[mask][None]  # [1, T], row by row
    targets = shift_labels(labels[mask][None], cu_seqlens=cu, ignore_index=ignore_index)
    # a packed position's column in its padded row, and the flat row-layout index of the
    # prediction made there (the layout's column t predicts token t + 1)
    column = torch.arange(width, device=input_ids.device).expand(rows, width)[mask]  # [T]
    row = torch.arange(rows, device=input_ids.device)[:, None].expand(rows, width)[mask]
    index = torch.where(targets[0] != ignore_index, row * columns + column, -1)[None]
    padding = pad_documents(cu, plan)
    sharded = shard_batch(
        plan,
        padding.apply(packed_ids, pad_token_id),
        labels=padding.apply(targets, ignore_index),
        shift=False,
        cu_seqlens=padding.cu_seqlens,
        ignore_index=ignore_index,
    )
    real = padding.apply(torch.ones_like(packed_ids, dtype=torch.bool), False)
    device = sharded.input_ids.device
    real = plan.shard(real, packed=sharded.packed).to(device)
    index = plan.shard(padding.apply(index, -1), packed=sharded.packed).to(device)
    batch = ShardedBatch(
        sharded.input_ids, sharded.labels, sharded.position_ids, sharded.packed,
        sharded.fingerprint, real,
    )  # fmt: skip
    group = plan.sp_group if plan.sp_degree > 1 else None
    return RowShard(batch, index, rows, columns, group)

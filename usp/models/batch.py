"""From a global batch to what one SP rank feeds a model: shifted labels, shards, RoPE
positions and the packed-sequence description, all from one :class:`usp.Plan`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.models.labels import IGNORE_INDEX, shift_labels
from usp.plan import PackedSequence, as_plan


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's part of a global batch. ``labels`` are the globally shifted labels'
    shard (None if none were asked for); ``position_ids`` [B, S/P] int64."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    position_ids: torch.Tensor
    packed: PackedSequence | None

    def model_kwargs(self) -> dict:
        """Keyword arguments of ``usp.models.Llama`` (besides ``input_ids``)."""
        return {"labels": self.labels, "position_ids": self.position_ids, "cu_seqlens": self.packed}

    def hf_kwargs(self) -> dict:
        """Keyword arguments of an HF model whose attention is ``usp.models.hf.register``'s
        (labels are left out on purpose: HF's own loss is wrong under SP)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "usp_packed": self.packed,
            "use_cache": False,
        }


def shard_batch(
    plan,
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    with_labels: bool = True,
) -> ShardedBatch:
    """Shard a global batch ``input_ids`` [B, S] for this rank.

    ``labels``: HF's convention, targets aligned with the tokens (e.g. the tokens with
    ``ignore_index`` on prompt positions); ``None`` means the tokens themselves. They are
    shifted on the *global* sequence (:func:`usp.models.shift_labels`, honouring
    ``cu_seqlens``) and then sharded like the tokens. ``cu_seqlens``: int32 boundaries of
    a packed sequence (B = 1; collective: every SP rank calls this with the same ones).
    """
    plan = as_plan(plan)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a global [B, S] batch, got {tuple(input_ids.shape)}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
        )
    packed = None if cu_seqlens is None else plan.pack(cu_seqlens, device=input_ids.device)
    shifted = None
    if with_labels:
        source = input_ids if labels is None else labels
        shifted = plan.shard(
            shift_labels(source, cu_seqlens=cu_seqlens, ignore_index=ignore_index), packed=packed
        )
    positions = plan.position_ids(input_ids.shape[1], packed=packed, device=input_ids.device)
    return ShardedBatch(
        input_ids=plan.shard(input_ids, packed=packed),
        labels=shifted,
        position_ids=positions.expand(input_ids.shape[0], -1),
        packed=packed,
    )

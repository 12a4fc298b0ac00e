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
        """Keyword arguments of a usp model (besides ``input_ids``)."""
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
    shift: bool = True,
    device: torch.device | str | None = None,
) -> ShardedBatch:
    """Shard a global batch ``input_ids`` [B, S] for this rank: the one path from a global
    batch to a rank's shard (the trainer, the planner and the HF helpers use it).

    ``labels``: HF's convention, targets aligned with the tokens (e.g. the tokens with
    ``ignore_index`` on prompt positions); ``None`` means the tokens themselves. They are
    shifted on the *global* sequence (:func:`usp.models.shift_labels`, honouring
    ``cu_seqlens``) and then sharded like the tokens; ``shift=False``: ``labels`` are
    already the globally shifted targets (a packer's output), sharded as they are.
    ``cu_seqlens``: int32 boundaries of a packed sequence (B = 1; collective: every SP
    rank calls this with the same ones). ``device``: where the shards, the positions and
    the packed sequence's tensors go (default: ``input_ids``' device); the global batch
    is sharded where it is, so only a rank's share moves.
    """
    plan = as_plan(plan)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a global [B, S] batch, got {tuple(input_ids.shape)}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
        )
    if with_labels and not shift and labels is None:
        raise ValueError("shift=False needs the shifted labels (labels=...)")
    device = input_ids.device if device is None else torch.device(device)
    packed = None if cu_seqlens is None else plan.pack(cu_seqlens, device=device)
    shifted = None
    if with_labels:
        source = input_ids if labels is None else labels
        if shift:
            source = shift_labels(source, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
        shifted = plan.shard(source, packed=packed).to(device)
    positions = plan.position_ids(input_ids.shape[1], packed=packed, device=device)
    return ShardedBatch(
        input_ids=plan.shard(input_ids, packed=packed).to(device),
        labels=shifted,
        position_ids=positions.expand(input_ids.shape[0], -1),
        packed=packed,
    )

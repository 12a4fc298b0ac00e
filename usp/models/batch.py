"""From a global batch to what one SP rank feeds a model: shifted labels, shards, RoPE
positions and the packed-sequence description, all from one :class:`usp.Plan`.

Every SP rank of a group must shard the same global batch: a rank given another one
(a data loader that samples by rank instead of by data-parallel rank) would train on a
mix of two batches whose losses still look plausible. :func:`shard_batch` therefore
computes a cheap fingerprint of the global batch where it shards it
(:func:`batch_fingerprint`) and the SP ranks agree on it: in the same exchange as the
packed documents' boundaries (:meth:`usp.Plan.pack`), or in one of its own for a dense
batch. Different batches are one :class:`usp.RankDisagreementError` on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.comm.agreement import agree, can_agree, stable_hash
from usp.models.labels import IGNORE_INDEX, shift_labels
from usp.sp.packing import batch_field
from usp.sp.plan import PackedSequence, as_plan, documents_field

#: the modulus of the fingerprint's weighted sums (a prime: 2**31 - 1), small enough that
#: every product and every sum of up to 2**32 terms stays inside int64
_PRIME = 2_147_483_647
_MULTIPLIER = 48_271


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's part of a global batch. ``labels`` are the globally shifted labels'
    shard (None if none were asked for); ``position_ids`` [B, S/P] int64."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    position_ids: torch.Tensor
    packed: PackedSequence | None
    #: the global batch's :func:`batch_fingerprint`, agreed by the SP ranks (None: not
    #: computed, in one process or where ranks cannot agree: the ``fake`` backend)
    fingerprint: int | None = None
    #: [B, S/P] bool: False at the pads usp added to place documents on the layout
    #: (:func:`usp.models.hf.shard_flattened`); None: every token is the data's
    real: torch.Tensor | None = None

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
    rank calls this with the same ones), or the :class:`usp.sp.plan.PackedSequence` ``plan.pack``
    made of them (its tensors stay where it placed them; what a caller that packed
    outside a fake-tensor mode passes in). ``device``: where the shards, the positions and
    the packed sequence's tensors go (default: ``input_ids``' device); the global batch
    is sharded where it is, so only a rank's share moves.

    Collective under SP: the SP ranks agree on :func:`batch_fingerprint` of the global
    ``input_ids`` and ``labels`` (with the boundaries when packed), so ranks given
    different batches raise the same :class:`usp.RankDisagreementError`.
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
    fingerprint = None
    if plan.sp_degree > 1 and can_agree(plan.sp_group):
        fingerprint = batch_fingerprint(input_ids, labels)
    packed = None
    if isinstance(cu_seqlens, PackedSequence):  # packed already: agree on it with the batch
        packed = plan.packed_sequence(cu_seqlens, seq_len=input_ids.shape[1])
        cu_seqlens = packed.cu_seqlens
        if fingerprint is not None:
            fields = [documents_field(packed.bounds, "cu_seqlens"), batch_field(fingerprint)]
            agree(plan.sp_group, "shard_batch", fields)
    elif cu_seqlens is not None:  # one exchange agrees on the boundaries and the batch
        packed = plan.pack(cu_seqlens, device=device, batch_fingerprint=fingerprint)
    elif fingerprint is not None:
        agree(plan.sp_group, "shard_batch", [batch_field(fingerprint)])
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
        fingerprint=fingerprint,
    )


def batch_fingerprint(*tensors: torch.Tensor | None) -> int:
    """A cheap hash of a global batch's integer tensors (tokens, labels; None entries
    count as absent): equal for equal tensors on every rank and device; for different
    ones equal only by a coincidence of two weighted sums modulo a prime.

    Two lanes per tensor, ``sum(x_i * w_i) mod p`` with weights linear and quadratic in
    the position ``i``, computed where the tensor is (a few elementwise operations over
    its elements, no copy to the host), combined with the shapes on the host after one
    sync. A swapped, changed or shifted token changes both lanes."""
    lanes, shapes = [], []
    for tensor in tensors:
        if tensor is None:
            shapes.append(-1)
            continue
        flat = tensor.reshape(-1).to(torch.int64).remainder(_PRIME)  # [N] in [0, p)
        position = torch.arange(1, flat.numel() + 1, device=flat.device).remainder(_PRIME)
        linear = position.mul(_MULTIPLIER).remainder(_PRIME)  # < 2**47
        quadratic = position.mul(position).remainder(_PRIME)  # < 2**62
        for weights in (linear, quadratic):
            lanes.append(flat.mul(weights).remainder(_PRIME).sum())  # terms < 2**31
        shapes += [tensor.dim(), *tensor.shape]
    values = torch.stack(lanes).tolist() if lanes else []  # the one host sync
    return stable_hash([*shapes, *values])

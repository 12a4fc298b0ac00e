"""Cross-entropy over a sequence sharded across the SP group, exact and memory-bounded.

The contract (what :func:`sp_cross_entropy` and ``Llama(..., labels=...)`` return):

* the **value** is the mean over every non-ignored label of the *global* sequence
  (``sum over all SP ranks / global count``), identical on every SP rank;
* its **gradient** is this rank's share, ``d(local sum) / global count``, so that the SUM
  over the SP group of each parameter's gradient equals the single-process gradient.

It is built as ``global_sum / N + (local_sum - detach(local_sum)) / N``. ``N`` is the
global label count (one ``all_reduce`` on the SP group, together with the sums), or a
caller's ``num_items_in_batch`` (gradient accumulation: the labels of all micro-batches,
so that summing the micro-batch losses gives the mean over all of them). A global count
of zero gives a loss of 0 (no NaN), and a rank without labels still back-propagates
(zeros), so the collectives inside attention's backward run on every rank.

Memory: logits are computed only for labelled tokens, ``chunk_tokens`` rows at a time,
each chunk under activation checkpointing (recomputed in backward), so neither
``[S/P, V]`` logits nor their gradient ever exist at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from usp.models.labels import IGNORE_INDEX

#: rows of logits computed at once; at Llama-3's 128,256 vocabulary a chunk of 1024
#: tokens is 0.5 GiB of float32 logits (and as much for their gradient in backward)
DEFAULT_LOSS_CHUNK_TOKENS = 1024


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits are upcast to float32 for the softmax (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """hidden [n, dim], weight [V, dim], targets [n] -> sum of -log p(target), a scalar."""
    logits = F.linear(hidden, weight).to(loss_dtype(hidden.dtype))  # [n, V]
    return F.cross_entropy(logits, targets, reduction="sum")


def check_chunk_tokens(chunk_tokens: int | None) -> int | None:
    if chunk_tokens is not None and (
        not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1
    ):
        raise ValueError(
            f"loss_chunk_tokens must be a positive integer, or None for one unchunked pass; "
            f"got {chunk_tokens!r}"
        )
    return chunk_tokens


def cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, int]:
    """This rank's ``(sum of token losses, number of labelled tokens)``; no communication.

    hidden [..., dim] (final-norm output), weight [V, dim] (output projection), labels
    [...] (already shifted; ``ignore_index`` marks tokens without a target). The sum is
    float32 (float64 for float64 inputs) and always part of the autograd graph, also
    when there is nothing to sum. ``chunk_tokens=None``: one pass that materialises all
    logits (for comparisons). Selecting the labelled tokens costs one host sync.
    """
    check_chunk_tokens(chunk_tokens)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the token shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    flat_labels = labels.reshape(-1)
    labelled = (flat_labels != ignore_index).nonzero().squeeze(1)  # [n] (host sync)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, labelled)  # [n, dim]
    targets = flat_labels.index_select(0, labelled)  # [n]
    count = labelled.numel()
    if chunk_tokens is None or count <= chunk_tokens:
        # one chunk; an empty one still links hidden and weight to the graph (zero grads)
        return _chunk_loss_sum(hidden, weight, targets), count
    total = None
    for hidden_chunk, target_chunk in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
        part = checkpoint(_chunk_loss_sum, hidden_chunk, weight, target_chunk, use_reentrant=False)
        total = part if total is None else total + part
    return total, count


def sp_normalise(
    local_sum: torch.Tensor,
    local_count: int,
    group=None,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The SP loss of the module docstring from each rank's ``(local_sum, local_count)``.

    ``group``: the SP process group (``plan.sp_group``); ``None`` means single-process.
    ``num_items_in_batch``: the denominator to use instead of the global label count.
    One ``all_reduce`` of two float64 numbers (sum and count) on ``group``.
    """
    if num_items_in_batch is not None and float(num_items_in_batch) < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {num_items_in_batch}")
    # [sum, count] in float64: counts stay exact, sums are added without float32 rounding
    totals = torch.stack(
        [
            local_sum.detach().to(torch.float64),
            torch.tensor(float(local_count), dtype=torch.float64, device=local_sum.device),
        ]
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    denominator = totals[1] if num_items_in_batch is None else num_items_in_batch
    denominator = torch.as_tensor(denominator, dtype=torch.float64, device=local_sum.device)
    denominator = denominator.clamp(min=1)  # no labels anywhere: the sums are 0, so is the loss
    # value: global_sum / N, computed in float64 from all-reduced numbers, so the same bits
    # on every rank (the second term is exactly 0); gradient: d(local_sum) / N
    value = (totals[0] / denominator).to(local_sum.dtype)
    return value + (local_sum - local_sum.detach()) / denominator.to(local_sum.dtype)


def sp_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over the global sequence (contract: module docstring).

    hidden [B, S/P, dim] this rank's final hidden states, weight [V, dim], labels
    [B, S/P] this rank's shard of the globally shifted labels.
    """
    local_sum, count = cross_entropy_sum(
        hidden, weight, labels, ignore_index=ignore_index, chunk_tokens=chunk_tokens
    )
    return sp_normalise(local_sum, count, group, num_items_in_batch=num_items_in_batch)


def count_labels(labels: torch.Tensor, group=None, *, ignore_index: int = IGNORE_INDEX) -> int:
    """Non-ignored labels summed over ``group`` (collective when ``group`` is given): the
    ``num_items_in_batch`` of a step, when called on the concatenation (or sum) of its
    micro-batches' label shards."""
    count = (labels != ignore_index).sum().to(torch.int64).reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return int(count.item())

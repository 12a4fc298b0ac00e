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
by one autograd function over all chunks (:func:`chunked_cross_entropy_sum`) that keeps
one float32 log-sum-exp per labelled token for its backward (and the hidden states, not
a copy of the labelled rows) and recomputes each chunk's logits there, so neither
``[S/P, V]`` logits nor their gradient ever exist at once. Its loops are
memory-periodic (:mod:`usp.models.tiling`): everything that outlives a chunk (the sum,
the log-sum-exps, both gradients) is allocated before the loop and written in place,
and each chunk's work happens in a function of its own, so ``usp plan`` runs its first
and last chunk only under fake tensors, with the same footprint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp.errors import InputError
from usp.models.labels import IGNORE_INDEX
from usp.models.tiling import representative, tiles

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
    when there is nothing to sum. ``chunk_tokens``: rows per chunk of
    :func:`chunked_cross_entropy_sum`, whatever the count (none included); ``None``: one
    pass through autograd that materialises all logits (for comparisons). Selecting
    the labelled tokens costs one host sync.

    Under ``torch.compile`` nothing depends on the labels' values: every token's row is
    computed (chunked alike) and the ignored ones are masked out of the sum (their
    gradient is zero), so the graph has no data-dependent shape; the count is then an
    int64 tensor. The value is the same up to the order of the float additions.
    """
    check_chunk_tokens(chunk_tokens)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the token shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    flat_labels = labels.reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, dim], a view
    if torch.compiler.is_compiling():
        return _masked_sum(flat, weight, flat_labels, ignore_index, chunk_tokens)
    labelled = (flat_labels != ignore_index).nonzero().squeeze(1)  # [n] (host sync)
    targets = flat_labels.index_select(0, labelled)  # [n]
    count = labelled.numel()
    if chunk_tokens is None:  # one pass through autograd (zero grads when empty)
        return _chunk_loss_sum(flat.index_select(0, labelled), weight, targets), count
    return _ChunkedCrossEntropy.apply(flat, weight, targets, labelled, chunk_tokens, None), count


def _masked_sum(flat, weight, flat_labels, ignore_index, chunk_tokens):
    """:func:`cross_entropy_sum` without data-dependent shapes (compiled graphs): every
    row, its ignored labels masked. Returns (sum, count as an int64 tensor)."""
    keep = flat_labels != ignore_index  # [N]
    count = keep.sum()
    # the ignored rows zeroed: nothing of theirs (a NaN included) reaches a sum or a
    # gradient through the products, as eagerly, where they are never selected
    flat = torch.where(keep.unsqueeze(1), flat, 0)
    if chunk_tokens is None:
        logits = F.linear(flat, weight).to(loss_dtype(flat.dtype))  # [N, V]
        return F.cross_entropy(
            logits, flat_labels, ignore_index=ignore_index, reduction="sum"
        ), count
    targets = torch.where(keep, flat_labels, 0)  # any class for the masked rows
    return _ChunkedCrossEntropy.apply(flat, weight, targets, None, chunk_tokens, keep), count


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    *,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [N, dim], weight [V, dim], targets [n] int64, rows [n] int64 (the rows of
    ``hidden`` the targets belong to, distinct; ``None``: every row, n == N) -> the sum
    over them of ``-log softmax(hidden[row] @ weight.T)[target]``, a scalar in
    :func:`loss_dtype`, computed ``chunk_tokens`` targets at a time.

    Equal to :func:`_chunk_loss_sum` over ``hidden[rows]`` (autograd through
    ``F.linear`` and ``F.cross_entropy``) up to float rounding, value and both
    gradients; rows without a target get a zero gradient; ``n == 0`` gives 0, in the
    graph, with zero gradients. Saved for backward: ``hidden`` itself (no copy of the
    selected rows), ``weight``, ``targets``, ``rows`` and the ``[n]`` log-sum-exps;
    backward recomputes each chunk's logits and writes ``dhidden`` [N, dim] directly, so
    the memory is the same whatever the number of targets. See
    :class:`_ChunkedCrossEntropy` for dtypes.
    """
    check_chunk_tokens(chunk_tokens)
    if chunk_tokens is None:
        raise InputError("chunked_cross_entropy_sum needs an integer chunk_tokens, not None")
    if rows is None:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1 or rows.shape != targets.shape:
        raise InputError(
            f"need hidden [N, dim], weight [V, dim], targets [n] and rows [n]; got hidden "
            f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
            f"{tuple(targets.shape)}, rows {tuple(rows.shape)}"
        )
    if hidden.dtype != weight.dtype or hidden.shape[1] != weight.shape[1]:
        raise InputError(
            f"hidden and weight need one dtype and one dim; got {hidden.dtype} "
            f"{tuple(hidden.shape)} and {weight.dtype} {tuple(weight.shape)}"
        )
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, rows, chunk_tokens, None)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The loss sum over chunks of targets, forward and backward memory-periodic.

    Dtypes, as autograd gives them through ``F.linear(h, w).to(loss_dtype)`` and
    ``F.cross_entropy``: logits in the input dtype, upcast to :func:`loss_dtype` for
    the log-sum-exp and the sum; in backward the logits' gradient ``grad *
    (softmax - onehot)`` in :func:`loss_dtype`, cast to the input dtype before the two
    matmuls (autograd's ``ToCopy`` backward does the same cast).

    ``dweight`` [V, dim] accumulates in the weight's dtype: each chunk adds its
    ``d.T @ hidden`` with ``addmm_`` (the product accumulated inside the matmul, added to
    the accumulator and rounded once per chunk: on CPU bit-equal to rounding the float32
    ``dweight + d.T @ hidden`` once), where autograd rounds each chunk's ``[V, dim]``
    product to that dtype and then adds it in that dtype (two roundings per chunk, and a
    ``[V, dim]`` temporary per chunk). A float32 accumulator would round less in bf16 but
    cost ``[V, dim]`` float32 (2 GiB at Llama-3-8B's vocabulary) beyond the gradient
    itself. ``dhidden`` [N, dim] (input dtype) starts at zero and each chunk adds its
    rows' gradients (``index_add_`` of distinct rows into zeros: exact).

    Memory against selecting the labelled rows first (``index_select``, whose backward
    builds two ``[N, dim]`` tensors out of place beside the ``[n, dim]`` gradient): at
    every label count the backward holds ``hidden``, ``dhidden`` and a chunk's tensors.

    ``rows=None``: target i belongs to row i (chunks are slices of ``hidden``, no
    index). ``keep`` ([n] bool, or None for all): targets that count; the others add
    nothing to the sum and get a zero gradient (compiled graphs mask the ignored labels
    instead of selecting the labelled rows, see :func:`cross_entropy_sum`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, chunk, keep):
        wide = loss_dtype(hidden.dtype)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        lse = torch.empty(targets.shape, dtype=wide, device=hidden.device)  # [n]
        # memory-periodic (usp.models.tiling): total and lse exist before the loop and are
        # written in place; a chunk's [chunk, V] tensors are freed when its function returns
        ctx.representative = representative(hidden)
        for part in tiles(targets.shape[0], chunk, representative_only=ctx.representative):
            chunk_keep = None if keep is None else keep[part]
            rows_part = part if rows is None else rows[part]
            _forward_chunk(hidden, rows_part, weight, targets[part], chunk_keep, lse[part], total)
        ctx.save_for_backward(hidden, weight, targets, rows, lse, keep)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, rows, lse, keep = ctx.saved_tensors
        dhidden = None  # [N, dim]
        if ctx.needs_input_grad[0]:
            dhidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        dweight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # [V, dim]
        # memory-periodic as the forward: dhidden and dweight exist before the loop
        for part in tiles(targets.shape[0], ctx.chunk, representative_only=ctx.representative):
            chunk_keep = None if keep is None else keep[part]
            rows_part = part if rows is None else rows[part]
            _backward_chunk(
                grad, hidden, rows_part, weight, targets[part], chunk_keep, lse[part], dhidden,
                dweight,
            )  # fmt: skip
        return dhidden, dweight, None, None, None, None


def _rows_of(hidden: torch.Tensor, rows) -> torch.Tensor:
    """hidden [N, dim] -> the chunk's [c, dim]: a slice of rows (a view), or an index."""
    return hidden[rows] if isinstance(rows, slice) else hidden.index_select(0, rows)


def _forward_chunk(hidden, rows, weight, targets, keep, lse, total) -> None:
    """One chunk: hidden [N, dim], rows (a slice or [c] indices), targets [c], keep [c]
    or None -> lse [c] written, total += the chunk's sum of ``lse - target logit`` over
    the kept targets, in place."""
    picked = _rows_of(hidden, rows)  # [c, dim]
    wide = picked.mm(weight.t()).to(lse.dtype)  # [c, V]: input dtype, then upcast
    del picked
    target_logit = wide.gather(1, targets.unsqueeze(1)).squeeze(1)  # [c]
    top = wide.amax(1, keepdim=True)  # [c, 1]
    wide.sub_(top).exp_()  # in place: wide is this chunk's own tensor
    lse.copy_(wide.sum(1).log_().add_(top.squeeze(1)))
    losses = lse - target_logit
    if keep is not None:  # a where, not a product: a masked row's non-finite value stays out
        losses = torch.where(keep, losses, 0.0)
    total.add_(losses.sum())


def _backward_chunk(grad, hidden, rows, weight, targets, keep, lse, dhidden, dweight) -> None:
    """One chunk's gradients: hidden [N, dim], rows, targets, keep, lse [c]; ``dhidden``
    [N, dim] and ``dweight`` [V, dim] added to in place (either may be None)."""
    picked = _rows_of(hidden, rows)  # [c, dim]
    probs = picked.mm(weight.t()).to(lse.dtype)  # [c, V], recomputed as in forward
    probs.sub_(lse.unsqueeze(1)).exp_()  # softmax
    index = targets.unsqueeze(1)  # [c, 1]
    probs.scatter_(1, index, probs.gather(1, index) - 1)  # softmax - onehot
    if keep is not None:
        probs = torch.where(keep.unsqueeze(1), probs, 0.0)
    dlogits = probs.mul_(grad).to(hidden.dtype)  # [c, V], autograd's dtype for the matmuls
    del probs
    if dhidden is not None:
        if isinstance(rows, slice):
            dhidden[rows].add_(dlogits.mm(weight))
        else:
            dhidden.index_add_(0, rows, dlogits.mm(weight))  # [c, dim] into the chunk's rows
    if dweight is not None:
        dweight.addmm_(dlogits.t(), picked)


def sp_normalise(
    local_sum: torch.Tensor,
    local_count: int | torch.Tensor,
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
    if isinstance(local_count, torch.Tensor):  # compiled (cross_entropy_sum): on the device
        count = local_count.to(torch.float64)
    else:
        count = torch.tensor(float(local_count), dtype=torch.float64, device=local_sum.device)
    totals = torch.stack([local_sum.detach().to(torch.float64), count])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    denominator = totals[1] if num_items_in_batch is None else num_items_in_batch
    denominator = torch.as_tensor(denominator, dtype=torch.float64, device=local_sum.device)
    denominator = denominator.clamp(min=1)  # no labels anywhere: the sums are 0, so is the loss
    # value: global_sum / N, computed in float64 from all-reduced numbers, so the same bits
    # on every rank (the second term is exactly 0); gradient: d(local_sum) / N
    value = (totals[0] / denominator).to(local_sum.dtype)
    return value + (local_sum - local_sum.detach()) / denominator.to(local_sum.dtype)


def sp_logits_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sp_cross_entropy`'s contract from this rank's materialised ``logits``
    [B, S/P, V] (a model whose logits are no plain projection of the hidden states:
    Gemma 3's soft cap), ``labels`` [B, S/P]."""
    local = F.cross_entropy(
        logits.flatten(0, 1).to(loss_dtype(logits.dtype)),
        labels.flatten(),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = int((labels != ignore_index).sum())
    return sp_normalise(local, count, group, num_items_in_batch=num_items_in_batch)


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

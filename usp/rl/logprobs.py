"""Per-token log-probabilities (and entropies) of given target tokens, from hidden
states, ``chunk_tokens`` tokens at a time: the loss-chunk machinery of
:mod:`usp.models.loss` for reinforcement learning and preference training.

The contract (:func:`token_logprobs`): for every token with a target,

* ``logprobs = log softmax(hidden @ weight.T / temperature)[target]``,
* ``entropy = -sum_v p_v log p_v`` of that distribution (``outputs`` ``"entropy"``),
* ``mean_logits``: the mean over the vocabulary of ``hidden @ weight.T / temperature``,
* ``is_top1``: whether the target is the distribution's first argmax,

computed on this rank's tokens only (no communication: a sequence-parallel rank passes
its shard of the final hidden states and of the globally shifted targets, see
:mod:`usp.rl.rows`). Gradients flow through ``logprobs`` and ``entropy`` to ``hidden``
and ``weight``.

Memory: only the tokens with a target are computed, ``chunk_tokens`` rows of logits at
a time, by one autograd function (:class:`_ChunkedTokenStats`) that keeps the hidden
states (not a copy of the selected rows), one log-sum-exp per target and, when the
entropy is asked for, one entropy per target; its backward recomputes each chunk's
logits. Neither ``[S/P, V]`` logits nor their gradient exist at once, and the
vocabulary is never gathered from other ranks. The loops are memory-periodic
(:mod:`usp.models.tiling`), as the loss's are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from usp.errors import InputError
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, check_chunk_tokens, loss_dtype
from usp.models.tiling import representative, tiles

#: the per-token values besides the log-probabilities, each computed only when asked for
OPTIONAL_OUTPUTS = ("entropy", "mean_logits", "is_top1")


@dataclass(frozen=True)
class TokenStats:
    """What :func:`token_logprobs` returns, each shaped like its ``targets``: zeros
    (False) where a token has no target. Floats in :func:`usp.models.loss.loss_dtype`
    of the hidden states (float32, float64 for float64)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


def check_temperature(temperature) -> float:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise InputError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    outputs: tuple[str, ...] = (),
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> TokenStats:
    """The per-token statistics of the module docstring.

    hidden [..., dim] (the final norm's output), weight [V, dim] (the output
    projection, no bias), targets [...] int64 (the next token each position predicts,
    ``ignore_index`` where none). ``outputs``: any of :data:`OPTIONAL_OUTPUTS`.
    Selecting the tokens with a target costs one host sync."""
    check_chunk_tokens(chunk_tokens)
    if chunk_tokens is None:
        raise InputError("token_logprobs needs an integer chunk_tokens, not None")
    inv_temperature = 1.0 / check_temperature(temperature)
    unknown = sorted(set(outputs) - set(OPTIONAL_OUTPUTS))
    if unknown:
        raise InputError(f"unknown outputs {unknown}: choose from {list(OPTIONAL_OUTPUTS)}")
    if hidden.shape[:-1] != targets.shape:
        raise InputError(
            f"targets shape {tuple(targets.shape)} must equal the token shape "
            f"{tuple(hidden.shape[:-1])} of hidden {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.dtype != weight.dtype:
        raise InputError(
            f"need weight [V, {hidden.shape[-1]}] in {hidden.dtype}, got "
            f"{tuple(weight.shape)} in {weight.dtype}"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, dim], a view
    flat_targets = targets.reshape(-1)
    rows = (flat_targets != ignore_index).nonzero().squeeze(1)  # [n] (host sync)
    picked = flat_targets.index_select(0, rows)  # [n]
    vocab = weight.shape[0]
    if bool(((picked < 0) | (picked >= vocab)).any()):
        raise InputError(
            f"targets must be token ids in [0, {vocab}) or ignore_index={ignore_index}"
        )
    flags = tuple(name in outputs for name in OPTIONAL_OUTPUTS)
    values = _ChunkedTokenStats.apply(
        flat, weight, picked, rows, chunk_tokens, inv_temperature, flags
    )
    results = []
    for value in values:
        if value is None:
            results.append(None)
            continue
        full = torch.zeros(flat_targets.shape, dtype=value.dtype, device=value.device)
        results.append(full.index_copy(0, rows, value).reshape(targets.shape))  # [...]
    return TokenStats(*results)


class _ChunkedTokenStats(torch.autograd.Function):
    """Per-target log-probabilities (and the optional statistics) over chunks of
    targets; forward and backward memory-periodic.

    Dtypes as in :class:`usp.models.loss._ChunkedCrossEntropy`: logits in the input
    dtype, upcast to :func:`loss_dtype` (then divided by the temperature) for the
    softmax; in backward the logits' gradient in :func:`loss_dtype`, cast to the input
    dtype for the two matmuls. With ``s = logits / T``, ``p = softmax(s)`` and the
    incoming gradients ``g`` (log-probs) and ``h`` (entropies), the gradient of ``s`` is
    ``g (onehot - p) - h p (log p + H)``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, chunk, inv_temperature, flags):
        ctx.set_materialize_grads(False)
        want_entropy, want_mean, want_top1 = flags
        wide = loss_dtype(hidden.dtype)
        n = targets.shape[0]
        new = {"dtype": wide, "device": hidden.device}
        logprobs, lse = torch.empty(n, **new), torch.empty(n, **new)
        entropy = torch.empty(n, **new) if want_entropy else None
        mean_logits = torch.empty(n, **new) if want_mean else None
        is_top1 = torch.empty(n, dtype=torch.bool, device=hidden.device) if want_top1 else None
        ctx.representative = representative(hidden)
        for part in tiles(n, chunk, representative_only=ctx.representative):
            _forward_chunk(
                hidden, rows[part], weight, targets[part], inv_temperature, logprobs[part],
                lse[part], None if entropy is None else entropy[part],
                None if mean_logits is None else mean_logits[part],
                None if is_top1 is None else is_top1[part],
            )  # fmt: skip
        ctx.save_for_backward(hidden, weight, targets, rows, lse, entropy)
        ctx.chunk, ctx.inv_temperature = chunk, inv_temperature
        for value in (mean_logits, is_top1):
            if value is not None:
                ctx.mark_non_differentiable(value)
        return logprobs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, targets, rows, lse, entropy = ctx.saved_tensors
        dhidden = dweight = None
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        if ctx.needs_input_grad[0]:
            dhidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        if ctx.needs_input_grad[1]:
            dweight = torch.zeros_like(weight)  # [V, dim]
        for part in tiles(targets.shape[0], ctx.chunk, representative_only=ctx.representative):
            _backward_chunk(
                hidden, rows[part], weight, targets[part], ctx.inv_temperature, lse[part],
                None if entropy is None else entropy[part],
                None if grad_logprobs is None else grad_logprobs[part],
                None if grad_entropy is None else grad_entropy[part], dhidden, dweight,
            )  # fmt: skip
        return dhidden, dweight, None, None, None, None, None


def _scaled_logits(hidden, rows, weight, inv_temperature, wide) -> torch.Tensor:
    """hidden [N, dim], rows [c] -> the chunk's ``logits / T`` [c, V] in ``wide``."""
    picked = hidden.index_select(0, rows)  # [c, dim]
    return picked.mm(weight.t()).to(wide).mul_(inv_temperature)  # [c, V]


def _forward_chunk(
    hidden, rows, weight, targets, inv_temperature, logprobs, lse, entropy, mean_logits, is_top1
) -> None:
    """One chunk's values, written in place into the [c] slices given."""
    scaled = _scaled_logits(hidden, rows, weight, inv_temperature, lse.dtype)  # [c, V]
    target = scaled.gather(1, targets.unsqueeze(1)).squeeze(1)  # [c]
    if mean_logits is not None:
        mean_logits.copy_(scaled.mean(1))
    if is_top1 is not None:
        is_top1.copy_(scaled.argmax(1) == targets)
    top = scaled.amax(1, keepdim=True)  # [c, 1]
    shifted = scaled - top  # [c, V]
    exp = shifted.exp()
    total = exp.sum(1)  # [c]
    lse.copy_(total.log().add_(top.squeeze(1)))
    logprobs.copy_(target - lse)
    if entropy is not None:  # H = lse - sum_v p_v s_v
        entropy.copy_(lse - (exp * scaled).sum(1) / total)


def _backward_chunk(
    hidden, rows, weight, targets, inv_temperature, lse, entropy, grad_logprobs, grad_entropy,
    dhidden, dweight,
) -> None:  # fmt: skip
    """One chunk's gradients, added in place to ``dhidden`` [N, dim] and ``dweight``."""
    scaled = _scaled_logits(hidden, rows, weight, inv_temperature, lse.dtype)  # [c, V]
    log_p = scaled.sub_(lse.unsqueeze(1))  # [c, V], in place
    probs = log_p.exp()
    dscaled = torch.zeros_like(probs)
    if grad_logprobs is not None:  # g (onehot - p)
        dscaled.sub_(probs * grad_logprobs.unsqueeze(1))
        index = targets.unsqueeze(1)
        dscaled.scatter_add_(1, index, grad_logprobs.unsqueeze(1).to(dscaled.dtype))
    if grad_entropy is not None:  # - h p (log p + H)
        dscaled.sub_(probs * (log_p + entropy.unsqueeze(1)) * grad_entropy.unsqueeze(1))
    dlogits = dscaled.mul_(inv_temperature).to(hidden.dtype)  # [c, V]
    del probs, log_p, dscaled
    if dhidden is not None:
        dhidden.index_add_(0, rows, dlogits.mm(weight))  # [c, dim] into the chunk's rows
    if dweight is not None:
        dweight.addmm_(dlogits.t(), hidden.index_select(0, rows))

"""One forward pass over a sequence sharded by the plan, scored token by token.

A sequence of ``L`` tokens (the same global tensor on every SP rank) is sharded with
:func:`usp.models.shard_batch`; each rank runs the model on its ``L/P`` tokens (exact
attention over the whole sequence) and, for each of its tokens, computes from the
logits at that position the loss of the next token and the greedy (argmax) next token.
Nothing is gathered: the scores stay where their positions live, with those positions,
and the callers sum what they need over the ranks (:mod:`usp.evaluation.runner`).

Greedy decoding under SP: the answer's positions are at the end of the sequence, which
under zigzag lives on ring rank 0 and under contiguous on the last rank. Rather than
gather logits or decode token by token (one sharded forward per new token), the
sequence holds the prompt followed by the expected answer, and each answer position
checks that the argmax at the position before it is that answer token. Greedy decoding
reproduces the answer exactly when every one of these checks passes (each greedy
token, given the correct tokens before it, is the correct one), so one forward decides
it, and the ranks only add up how many checks passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from usp.models import IGNORE_INDEX, ShardedBatch, shard_batch
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, loss_dtype


@dataclass(frozen=True)
class TokenScores:
    """This rank's tokens of one sequence, in local order (all ``[n]``, ``n = L/P``)."""

    positions: torch.Tensor  # int64: global position of each token
    labelled: torch.Tensor  # bool: the next token carries a loss (never at position L-1)
    loss: torch.Tensor  # float64: -log p(next token), 0 where not labelled
    greedy: torch.Tensor  # int64: the argmax next token


def final_hidden(model, batch: ShardedBatch) -> torch.Tensor:
    """[1, L/P, dim]: the decoder's output (after its final norm) for this rank's tokens.

    A usp model's own ``hidden_states`` (any family), which its ``logits`` (the output
    projection and any family's soft cap) turns into logits."""
    return model.hidden_states(
        batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.packed
    )


@torch.no_grad()
def score_tokens(
    model,
    plan,
    tokens: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> TokenScores:
    """Score the global sequence ``tokens`` (int64 [L], identical on every SP rank) on
    this rank's shard. ``target`` (bool [L]): which tokens carry a loss when predicted
    (the data formats' flags: a prompt's tokens do not); None: all. Forward only;
    collective over the SP group (attention). ``chunk_tokens`` rows of logits ``[chunk,
    V]`` exist at a time (the loss's own chunking: never ``[L/P, V]``)."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be one global sequence [L], got {tuple(tokens.shape)}")
    aligned = None  # HF's convention: labels aligned with the tokens, shifted by shard_batch
    if target is not None:
        aligned = torch.where(target.to(tokens.device), tokens, IGNORE_INDEX)[None]
    batch = shard_batch(plan, tokens[None], labels=aligned)  # the global shift, then sharded
    hidden = final_hidden(model, batch)[0]  # [L/P, dim]
    labels = batch.labels[0]  # [L/P]
    labelled = labels != IGNORE_INDEX
    loss = torch.zeros(labels.shape, dtype=torch.float64, device=labels.device)
    greedy = torch.empty(labels.shape, dtype=torch.int64, device=labels.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        logits = model.logits(hidden[rows]).to(loss_dtype(hidden.dtype))  # [c, V]
        greedy[rows] = logits.argmax(dim=-1)
        nll = F.cross_entropy(logits, labels[rows], ignore_index=IGNORE_INDEX, reduction="none")
        loss[rows] = nll.to(torch.float64)  # 0 where ignored
    return TokenScores(batch.position_ids[0], labelled, loss, greedy)

"""Preference pairs under sequence parallelism: DPO's per-sequence log-probability sums
of the chosen and the rejected completions.

TRL's ``DataCollatorForPreference`` lays a batch of ``B`` pairs out as ``2B`` rows, the
chosen completions first, each after its prompt, with a ``completion_mask``; as the
rows of :func:`usp.rl.shard_rows` (labels: the tokens where ``completion_mask`` is 1),
each row's sum is one sum over the SP group of its tokens' log-probabilities.
"""

from __future__ import annotations

import torch

from usp.errors import InputError
from usp.models.labels import IGNORE_INDEX
from usp.rl.rows import RowShard


def completion_labels(
    input_ids: torch.Tensor, completion_mask: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The labels :func:`usp.rl.shard_rows` scores for rows whose ``completion_mask``
    [B, S] marks the completion tokens (TRL's ``input_ids.masked_fill(completion_mask ==
    0, -100)``)."""
    if completion_mask.shape != input_ids.shape:
        raise InputError(
            f"completion_mask {tuple(completion_mask.shape)} must match input_ids "
            f"{tuple(input_ids.shape)}"
        )
    return input_ids.masked_fill(completion_mask == 0, ignore_index)


def preference_logps(logprobs: torch.Tensor, shard: RowShard) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs [1, S'/P] (this rank's per-token log-probabilities of a shard of ``2B``
    rows, chosen first) -> (chosen [B], rejected [B]): each completion's sum over its
    tokens, on every SP rank (value: the global sum; gradient: this rank's tokens', see
    :mod:`usp.rl.rows`)."""
    if shard.rows % 2:
        raise InputError(f"preference rows come in pairs (chosen, rejected), got {shard.rows}")
    chosen, rejected = shard.sequence_sums(logprobs).chunk(2)
    return chosen, rejected

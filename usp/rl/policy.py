"""TRL's GRPO policy losses where a sequence's tokens are spread over the SP ranks.

:func:`policy_loss` computes what TRL 1.16's ``GRPOTrainer._compute_loss`` computes for
one process -- here one data-parallel replica, whose batch its SP ranks share -- from
this rank's per-token log-probabilities (:func:`usp.rl.token_logprobs` on a
:class:`usp.rl.RowShard`): the loss types ``grpo``, ``bnpo``, ``dr_grpo`` and ``dapo``,
importance ratios per token or per sequence (GSPO), clipping with ``epsilon_low`` /
``epsilon_high`` (and TRL's two-sided ``delta``), and the KL to a reference model with
TRL's estimator ``exp(ref - logp) - (ref - logp) - 1`` (optionally multiplied by the
importance ratio, ``use_bias_correction_kl``).

Every quantity that spans a sequence (its log-ratio sum, its loss sum, its KL sum) is a
local sum plus one sum over the SP group (:meth:`usp.rl.RowShard.sequence_sums`), and
the loss is computed from those global sums, identically on every SP rank, so that the
SP ranks' gradients sum to the replica's gradient. Token counts come from the row
layout's masks (identical on every SP rank); ``dapo``'s normaliser is the generation
batch's completion-token count over every replica (``num_items_in_batch``) divided by
the replicas (``num_replicas``), as TRL divides its count over processes. As in TRL,
with several replicas each replica's loss is its own; average the gradients over the
replicas (TRL's DDP does; with usp's FSDP2, which sums, divide the loss by the replica
count), and the metrics are reduced over the replicas (``dp_group``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.errors import InputError
from usp.rl.rows import RowShard

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class PolicyLossConfig:
    """TRL's ``GRPOConfig`` fields the loss reads (same names, same defaults).
    ``epsilon_high`` None: ``epsilon``. ``gradient_accumulation_steps``: TRL's
    ``current_gradient_accumulation_steps`` (1 for an evaluation)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    delta: float | None = None
    use_bias_correction_kl: bool = False
    max_completion_length: int | None = None
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise InputError(f"loss_type={self.loss_type!r}: usp.rl computes {list(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise InputError(
                f"importance_sampling_level={self.importance_sampling_level!r}: choose "
                f"{list(IMPORTANCE_SAMPLING_LEVELS)}"
            )
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise InputError("loss_type='dr_grpo' normalises by max_completion_length: give it")
        for name in ("gradient_accumulation_steps", "steps_per_generation"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class PolicyLoss:
    """:func:`policy_loss`'s result: ``loss`` (this replica's, scaled for gradient
    accumulation as TRL's; the same value on every SP rank, gradient: this rank's share)
    and TRL's metrics over every replica (``kl``, ``entropy``, ``clip_ratio/...``)."""

    loss: torch.Tensor
    metrics: dict


def policy_loss(
    logprobs: torch.Tensor,
    shard: RowShard,
    *,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    num_replicas: int = 1,
    dp_group=None,
) -> PolicyLoss:
    """The loss of the module docstring.

    logprobs [1, S'/P]: this rank's per-token log-probabilities (with gradient);
    ``completion_mask`` [B, C] (TRL's loss mask over the last ``C`` row-layout columns:
    the completions), ``advantages`` [B] (or [B, C]), ``old_logprobs`` / ``ref_logprobs``
    [B, C] in the same layout (None: no importance sampling against an older policy /
    ``beta`` must be 0), ``entropy`` [1, S'/P] for the metric (optional).
    ``num_items_in_batch``: ``dapo``'s count (see the module docstring)."""
    rows, columns = completion_mask.shape
    if rows != shard.rows or columns > shard.columns:
        raise InputError(
            f"completion_mask {tuple(completion_mask.shape)} does not fit the shard's "
            f"{shard.rows} rows of {shard.columns} predictions"
        )
    if config.beta != 0.0 and ref_logprobs is None:
        raise InputError(f"beta={config.beta} needs ref_logprobs (the reference model's)")
    if config.loss_type == "dapo" and num_items_in_batch is None:
        raise InputError("loss_type='dapo' needs num_items_in_batch (see usp.rl.policy)")
    dtype = logprobs.dtype
    mask_rows = completion_mask.to(dtype)  # [B, C]
    counts = mask_rows.sum(-1)  # [B], global
    mask = shard.take(mask_rows)  # [1, S'/P]
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand(rows, columns)
    adv = shard.take(adv.to(dtype))
    old = logprobs.detach() if old_logprobs is None else shard.take(old_logprobs.to(dtype))
    log_ratio = logprobs - old
    low, high = 1 - config.epsilon_low, 1 + config.upper
    sums = shard.sequence_sums
    if config.importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)  # [1, S'/P]
    else:
        ratio = torch.exp(sums(log_ratio * mask) / counts.clamp(min=1.0))  # [B]
    kl = None
    if config.beta != 0.0:
        ref = shard.take(ref_logprobs.to(dtype))
        kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1  # [1, S'/P]
    clipped = torch.clamp(ratio, low, high)
    bias_ratio = ratio
    if config.delta is not None:
        ratio = torch.clamp(ratio, max=config.delta)
    seq_adv = advantages if advantages.dim() == 1 else None
    if config.importance_sampling_level == "token":
        token_loss = -torch.min(ratio * adv, clipped * adv)
        if kl is not None:
            token_kl = kl * bias_ratio if config.use_bias_correction_kl else kl
            token_loss = token_loss + config.beta * token_kl
        sequence_loss = sums(token_loss * mask)  # [B]
    else:
        if seq_adv is None:
            raise InputError("sequence-level importance sampling needs advantages [B]")
        seq_adv = seq_adv.to(dtype)
        sequence_loss = -torch.min(ratio * seq_adv, clipped * seq_adv) * counts
        if kl is not None:
            kl_sums = sums(kl * mask)
            if config.use_bias_correction_kl:
                kl_sums = kl_sums * bias_ratio
            sequence_loss = sequence_loss + config.beta * kl_sums
    loss = _aggregate(sequence_loss, counts, config, num_items_in_batch, num_replicas, rows)
    metrics = _metrics(
        shard, mask, counts, ratio, adv, seq_adv, kl, bias_ratio, entropy, config, dp_group
    )
    return PolicyLoss(loss, metrics)


def _aggregate(sequence_loss, counts, config, num_items, num_replicas, rows):
    """TRL's normalisation of the per-sequence loss sums [B] for one replica."""
    steps = config.gradient_accumulation_steps
    if config.loss_type == "grpo":
        return (sequence_loss / counts.clamp(min=1.0)).mean() / steps
    if config.loss_type == "bnpo":
        return sequence_loss.sum() / counts.sum().clamp(min=1.0) / steps
    if config.loss_type == "dr_grpo":
        return sequence_loss.sum() / (rows * config.max_completion_length) / steps
    items = torch.as_tensor(num_items, dtype=sequence_loss.dtype, device=sequence_loss.device)
    normaliser = items.clamp(min=1.0) / num_replicas * steps / config.steps_per_generation
    return sequence_loss.sum() / normaliser


def _reduce(values: list[torch.Tensor], group, op=dist.ReduceOp.SUM) -> list[torch.Tensor]:
    """Sums (or extremes) over the replicas of detached float64 values."""
    stacked = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, op=op, group=group)
    return list(stacked)


def _metrics(shard, mask, counts, ratio, adv, seq_adv, kl, bias_ratio, entropy, config, group):
    """TRL's logged metrics of the loss, over every replica (``group``: the dp group)."""
    sums = shard.sequence_sums
    total_tokens = counts.sum()
    token_level = config.importance_sampling_level == "token"
    sums_to_reduce, names = [], []
    if kl is not None:
        token_kl = kl * bias_ratio if config.use_bias_correction_kl and token_level else kl
        kl_total = sums(token_kl.detach() * mask).sum()
        if config.use_bias_correction_kl and not token_level:
            kl_total = (sums(kl.detach() * mask) * bias_ratio.detach()).sum()
        sums_to_reduce.append(kl_total)
        names.append("kl")
    if entropy is not None:
        sums_to_reduce.append(sums(entropy.detach() * mask).sum())
        names.append("entropy")
    ratio = ratio.detach()
    if token_level:
        low = ((ratio < 1 - config.epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + config.upper) & (adv > 0)).to(mask.dtype)
        per_seq = [sums(x * mask) for x in (low, high, torch.maximum(low, high))]
        per_seq_mean = [s / counts for s in per_seq[:2]]  # NaN for an empty sequence
        denominator = total_tokens
    else:
        low = ((ratio < 1 - config.epsilon_low) & (seq_adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + config.upper) & (seq_adv > 0)).to(mask.dtype)
        per_seq = [low, high, torch.maximum(low, high)]
        per_seq_mean = per_seq[:2]
        denominator = torch.tensor(float(low.numel()), dtype=low.dtype, device=low.device)
    sums_to_reduce += [s.sum() for s in per_seq]
    names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    reduced = _reduce([*sums_to_reduce, total_tokens, denominator], group)
    tokens, clip_count = reduced[-2], reduced[-1]
    metrics = {}
    for name, value in zip(names, reduced):
        count = clip_count if name.startswith("clip_ratio") else tokens
        metrics[name] = float(value / count.clamp(min=1.0))
    low_min = _nan_extreme(per_seq_mean[0], min, group)
    high_max = _nan_extreme(per_seq_mean[1], max, group)
    metrics["clip_ratio/low_min"], metrics["clip_ratio/high_max"] = low_min, high_max
    return metrics


def _nan_extreme(values: torch.Tensor, pick, group) -> float:
    """TRL's ``nanmin`` / ``nanmax`` of per-sequence values over every replica (NaN when
    every one is NaN)."""
    sign = -1.0 if pick is max else 1.0  # a maximum is the minimum of the negated values
    finite = values.detach().to(torch.float64)
    finite = sign * finite[~torch.isnan(finite)]
    value = finite.min() if finite.numel() else torch.tensor(math.inf, dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return math.nan if math.isinf(float(value)) else sign * float(value)

"""Rollouts of :class:`usp.integrations.trl_grpo.UspGRPOTrainer`: which prompts a
replica and each of its SP ranks generate for, the generating model, the rewards and
TRL's advantages.

* **Sampling** (:class:`ReplicaRepeatSampler`): TRL's ``RepeatSampler`` order (each
  prompt ``num_generations`` times in a row), cut into generation batches of
  ``per_device_train_batch_size x steps_per_generation x dp`` rows; replica ``d`` takes
  the ``d``-th share of each, as accelerate gives a process its share. A replica is
  what a TRL process is: every SP rank of a replica holds the same rows.
* **Generation** (:func:`group_slices`, :class:`RolloutModel`): the replica's rows are
  spread over its SP ranks by whole prompt groups (a prompt's completions are generated
  by one rank, in one ``generate`` call); each rank generates with SP off on a
  full-weight copy of the policy (transformers' own layers and attention, a KV cache),
  whose weights are copied from the FSDP2 shards before each generation batch (one
  gather of the parameters, in the same order on every rank: the ranks then generate
  independently, for as many steps as their own prompts need). Memory: one full copy of
  the weights per rank besides the shards.
* **Rewards** (:func:`evaluate_rewards`): each rank scores the completions it
  generated, once each (TRL's reward-function signature); completions and rewards are
  then all-gathered over the SP group, so every SP rank trains on the same rows.
* **Advantages** (:func:`advantages_of`): TRL's, over the rewards of every replica.
"""

from __future__ import annotations

import asyncio
import copy
import math

try:
    from trl.trainer.utils import nanstd, pad
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError("usp's GRPO trainer needs TRL: pip install usp[trl]") from None

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import Sampler

from usp.errors import ConfigError
from usp.models.hf_inputs import HFInputError


class ReplicaRepeatSampler(Sampler[int]):
    """Replica ``dp_rank``'s indices of ``inner`` (TRL's ``RepeatSampler``, whose order
    comes in whole generation batches of ``local * dp_degree`` indices): the
    ``dp_rank``-th ``local`` of each."""

    def __init__(self, inner: Sampler, *, local: int, dp_rank: int, dp_degree: int):
        self.inner, self.local = inner, local
        self.dp_rank, self.dp_degree = dp_rank, dp_degree

    def set_epoch(self, epoch: int) -> None:  # the inner sampler draws each epoch's order
        del epoch

    def __len__(self) -> int:
        return len(self.inner) // self.dp_degree

    def __iter__(self):
        size = self.local * self.dp_degree
        buffer = []
        for index in self.inner:
            buffer.append(index)
            if len(buffer) == size:
                yield from buffer[self.dp_rank * self.local : (self.dp_rank + 1) * self.local]
                buffer = []


def group_slices(rows: int, first_row: int, group_size: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of a replica's ``rows`` rows (the global generation
    batch's rows ``first_row`` ... ``first_row + rows - 1``, a prompt group being
    ``group_size`` rows starting at a multiple of it), each made of whole groups (a
    group cut by the replica's edge counts as one), balanced by rows; some may be
    empty when there are fewer groups than parts."""
    first_boundary = -(-first_row // group_size) * group_size - first_row
    boundaries = sorted({0, rows, *range(first_boundary, rows, group_size)})
    cuts = [0]
    for part in range(1, parts):
        target = part * rows / parts
        cut = min(boundaries, key=lambda b: (abs(b - target), -b))  # ties: the later cut
        cuts.append(max(cut, cuts[-1]))
    cuts.append(rows)
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


class RolloutModel:
    """The model that generates: a full-weight copy of the policy taken before usp
    prepared it (transformers' own layers), with sdpa attention (eager for a model
    without it) and a KV cache."""

    def __init__(self, policy: torch.nn.Module):
        self.model = copy.deepcopy(policy)
        self.model.requires_grad_(False)
        self.model.eval()
        attention = "sdpa" if getattr(self.model, "_supports_sdpa", False) else "eager"
        self.model.set_attn_implementation(attention)
        self.model.config.use_cache = True

    def check_names(self, policy: torch.nn.Module) -> None:
        """The prepared policy's parameters must be the copy's, name for name."""
        mine, theirs = parameter_names(self.model), parameter_names(policy)
        if mine != theirs:
            missing = sorted(set(mine) ^ set(theirs))[:4]
            raise ConfigError(
                "usp's GRPO rollout copy and the prepared policy name their parameters "
                f"differently (e.g. {missing}): the rollout weights cannot be kept in sync"
            )

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights (gathered from FSDP2's shards: a collective,
        every rank calls it) into the copy."""
        for (_, target), (_, source) in zip(
            self.model.named_parameters(), policy.named_parameters(), strict=True
        ):
            full = source.full_tensor() if isinstance(source, DTensor) else source
            target.copy_(full)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, generation_config, pad_token_id: int,
                 eos_token_ids: list[int], pad_to_multiple_of: int | None,
                 device) -> list[list[int]]:  # fmt: skip
        """Completion token ids of every prompt (TRL's single-turn generation: left-padded
        prompts, everything after the first end-of-sequence token cut off)."""
        self.model.to(device)
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        ids = pad(prompts, padding_value=pad_token_id, padding_side="left",
                  pad_to_multiple_of=pad_to_multiple_of).to(device)  # fmt: skip
        mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left",
                   pad_to_multiple_of=pad_to_multiple_of).to(device)  # fmt: skip
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, generation_config=generation_config
        )
        completions = out[:, ids.shape[1] :]  # [n, L]
        is_eos = torch.isin(completions, torch.tensor(eos_token_ids, device=completions.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.shape[1])
        keep = torch.arange(completions.shape[1], device=completions.device) <= first[:, None]
        return [row[m].tolist() for row, m in zip(completions.cpu(), keep.cpu(), strict=True)]


def evaluate_rewards(trainer, inputs: list, prompts: list, completions: list,
                     completion_ids: list) -> torch.Tensor:  # fmt: skip
    """[n, F] float32: each reward function (TRL's signature: ``prompts``,
    ``completions``, ``completion_ids`` and the data set's other columns, the trainer
    state, ``log_extra`` / ``log_metric``) on these completions, None as NaN."""
    device = trainer.accelerator.device
    rewards = torch.zeros(len(prompts), len(trainer.reward_funcs), device=device)
    if not prompts:
        return rewards
    keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")]
    kwargs = {key: [example[key] for example in inputs] for key in keys}
    kwargs.update(trainer_state=trainer.state, log_extra=trainer._log_completion_extra,
                  log_metric=trainer._log_metric)  # fmt: skip
    for column, (func, name) in enumerate(zip(trainer.reward_funcs, trainer.reward_func_names)):
        args = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        output = func(**args, **kwargs)
        if asyncio.iscoroutine(output):
            output = asyncio.run_coroutine_threadsafe(output, trainer.async_loop).result()
        values = [math.nan if r is None else r for r in output]
        if len(values) != len(prompts):
            raise HFInputError(
                f"the reward function {name!r} returned {len(values)} rewards for "
                f"{len(prompts)} completions: return one per completion"
            )
        rewards[:, column] = torch.tensor(values, dtype=torch.float32, device=device)
    return rewards


def advantages_of(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                  scale_rewards: str, aggregation: str):  # fmt: skip
    """TRL 1.16's advantages of every replica's completions (``rewards_per_func`` [N, F],
    prompt groups of ``num_generations`` consecutive rows): (advantages [N], the
    per-group spread's zero flags [N] for ``frac_reward_zero_std``)."""
    g = num_generations
    weights = weights.to(rewards_per_func.device)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if g > 1 else None
        else:  # "batch"
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else None
        std = torch.zeros_like(rewards) if std is None else std
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:  # "normalize_then_sum"
        grouped = rewards_per_func.view(-1, g, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        per_func = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (per_func * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = (
            nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        )
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero


def gather_objects(value, group) -> list:
    """``value`` of every rank of ``group`` (None: this rank's alone), in group order."""
    if group is None or dist.get_world_size(group) == 1:
        return [value]
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, value, group=group)
    return found


def gather_rows(values: torch.Tensor, group) -> torch.Tensor:
    """Equal-sized [n, ...] tensors of every rank of ``group`` concatenated in group
    order (None: ``values``)."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    found = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(found, values.contiguous(), group=group)
    return torch.cat(found)

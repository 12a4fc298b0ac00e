"""Run the long-context checks on a model and a plan: which rank scores what, and the
sums that make the results equal to one process.

Work items (every perplexity window and every passkey trial of every length) are dealt
to the dp replicas in turn (replica ``d`` takes items ``d, d + dp, ...``); the SP ranks
of a replica score each of its items together (one sharded forward). Each token of
every window is then held by exactly one rank, so the bucket sums and counts, added over
all ranks (one all-reduce at the end), are the one-process sums. A passkey trial is
decided inside its replica (its checks summed over the SP group); the replicas' pass
counts add up over the dp group. Every rank ends with the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.errors import ConfigError, DataError
from usp.evaluation.scoring import score_tokens
from usp.evaluation.tasks import (
    add_to_buckets,
    bucket_starts,
    passkey_checks,
    passkey_keys,
    passkey_prompt,
    window,
    window_count,
)

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class EvalSettings:
    """What ``usp eval`` measures (its flags)."""

    lengths: tuple[int, ...]
    buckets: int = 8  # position buckets per length
    windows: int = 4  # perplexity windows per length (at most; fewer if the data is short)
    passkey: bool = False
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 4  # passkey sequences per (length, depth)
    seed: int = 0  # the passkeys

    def __post_init__(self) -> None:
        if not self.lengths or any(not _positive_int(n) for n in self.lengths):
            raise ConfigError(f"--lengths must be positive integers, got {self.lengths}")
        for name in ("buckets", "windows", "trials"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(f"--{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise ConfigError(f"--depths must be numbers in [0, 1], got {self.depths}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_settings(settings: EvalSettings, plan, tokenizer, stream_tokens: int) -> list[str]:
    """Every length fits the layout, the buckets and (with ``--passkey``) a passkey
    sequence; the held-out stream fills at least one window of each length. Returns the
    notes for lengths with fewer windows than asked. Raises a :class:`ConfigError` (or
    :class:`DataError`) naming the value and what would be valid; no collective."""
    multiple, notes = plan.sequence_multiple, []
    for length in settings.lengths:
        if length % multiple:
            fit = -(-length // multiple) * multiple
            raise ConfigError(
                f"--lengths {length} is not a multiple of {multiple}, what the {plan.layout} "
                f"layout with ring={plan.ring_degree}, ulysses={plan.ulysses_degree} needs "
                f"(e.g. {fit})"
            )
        if settings.buckets > length - 1:
            raise ConfigError(
                f"--buckets {settings.buckets} is more than the {length - 1} predicted "
                f"positions of length {length}"
            )
        if settings.passkey:
            passkey_prompt(tokenizer, length, 0.0, 10000)  # raises if it does not fit
        count = window_count(stream_tokens, length, settings.windows)
        if count == 0:
            raise DataError(
                f"the held-out documents hold {stream_tokens} tokens, fewer than one window "
                f"of --lengths {length}; give more or longer documents (--data) or shorter "
                "--lengths"
            )
        if count < settings.windows:
            notes.append(
                f"length {length}: the held-out documents fill {count} window(s), not "
                f"--windows {settings.windows}"
            )
    return notes


def run_checks(
    model, plan, stream: torch.Tensor, target: torch.Tensor, tokenizer, settings: EvalSettings
) -> dict:
    """Perplexity by position (and passkey accuracy) at every length; see the module
    docstring. ``stream``: the held-out token stream (int64 [N], identical on every
    rank), ``target`` (bool [N]): which of its tokens carry a loss.
    A collective over the plan's topology; returns the JSON-able results on every rank:
    ``{"perplexity": {length: {...}}, "passkey": {length: {depth: accuracy}}}``."""
    device = next(model.parameters()).device
    topology = plan.topology
    dp, replica = topology.dp_degree, topology.dp_rank
    stream, target = stream.to(device), target.to(device)
    items = _items(settings, stream.numel())
    buckets = settings.buckets
    sums = torch.zeros((len(settings.lengths), buckets), dtype=torch.float64, device=device)
    counts = torch.zeros((len(settings.lengths), buckets), dtype=torch.int64, device=device)
    passed = torch.zeros(
        (len(settings.lengths), len(settings.depths)), dtype=torch.int64, device=device
    )
    keys = passkey_keys(settings.seed, settings.lengths, settings.depths, settings.trials)
    for item in items[replica::dp]:
        kind, li, length = item[0], item[1], settings.lengths[item[1]]
        if kind == "window":
            k = item[2]
            scores = score_tokens(model, plan, window(stream, length, k), window(target, length, k))
            add_to_buckets(scores, length, sums[li], counts[li])
        else:
            di, trial = item[2], item[3]
            depth = settings.depths[di]
            prompt = passkey_prompt(tokenizer, length, depth, keys[(length, depth, trial)])
            scores = score_tokens(model, plan, prompt.tokens.to(device))
            checks = passkey_checks(scores, prompt)
            if plan.sp_group is not None and plan.sp_degree > 1:
                dist.all_reduce(checks, group=plan.sp_group)  # this replica's ranks
            passed[li, di] += int(checks[0] == checks[1])
    if topology.world_size > 1:
        dist.all_reduce(sums, group=topology.dp_sp_group)  # every token counted once
        dist.all_reduce(counts, group=topology.dp_sp_group)
        if dp > 1:
            dist.all_reduce(passed, group=topology.dp_group)  # each replica's own trials
    return _results(settings, stream.numel(), sums.cpu(), counts.cpu(), passed.cpu())


def _items(settings: EvalSettings, stream_tokens: int) -> list[tuple]:
    """Every sequence to score, in one order on every rank."""
    items: list[tuple] = []
    for li, length in enumerate(settings.lengths):
        items += [
            ("window", li, k) for k in range(window_count(stream_tokens, length, settings.windows))
        ]
        if settings.passkey:
            items += [
                ("passkey", li, di, trial)
                for di in range(len(settings.depths))
                for trial in range(settings.trials)
            ]
    return items


def _results(settings, stream_tokens, sums, counts, passed) -> dict:
    perplexity, passkey = {}, {}
    for li, length in enumerate(settings.lengths):
        total, n = float(sums[li].sum()), int(counts[li].sum())
        perplexity[str(length)] = {
            "bucket_starts": bucket_starts(length, settings.buckets),
            "values": [_perplexity(float(s), int(c)) for s, c in zip(sums[li], counts[li])],
            "tokens": [int(c) for c in counts[li]],
            "overall": _perplexity(total, n),
            "windows": window_count(stream_tokens, length, settings.windows),
        }
        if settings.passkey:
            passkey[str(length)] = {
                f"{depth:g}": int(passed[li, di]) / settings.trials
                for di, depth in enumerate(settings.depths)
            }
    results = {"perplexity": perplexity}
    if settings.passkey:
        results["passkey"] = passkey
    return results


def _perplexity(loss_sum: float, count: int) -> float | None:
    if count == 0:
        return None
    try:
        return math.exp(loss_sum / count)
    except OverflowError:
        return math.inf

"""The search: every way to run a job on a cluster, each measured, fitted and timed.

:func:`layouts` lists every valid ``(ulysses, ring, dp)`` for the model's heads and
the nodes (:class:`usp.process_groups.rank_math.RankMap` validates each, so Ulysses
groups stay inside nodes unless the config allows otherwise) times the memory levers
(:class:`usp.models.Levers`, the object the trainer applies; :data:`LEVER_STEPS`). :func:`evaluate` measures each one's memory (the scaled step of
:mod:`usp.planner.measure`, through the plan's :class:`usp.planner.pool.Measurements`,
in process or in workers), checks it against the device's and the host's memory, and
estimates its step time (:func:`step_time`). :func:`max_seq_len` finds the longest
sequence some candidate fits; it says ahead which measurements it will wait for
(``measured.want``), so workers run them while it waits for others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from usp.config import ConfigError
from usp.models import LeverError, Levers, family_of
from usp.models.plan_inputs import kv_heads_per_ring
from usp.planner.footprint import Choice, Footprint, Target
from usp.planner.hardware import (  # noqa: F401 (also read from here)
    DEFAULT_GPU,
    DEFAULT_HOST_MEMORY_GIB,
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    GPU_MEMORY_GIB,
    MAX_ROW_TOKENS,
    NVSWITCH_GPUS,
)
from usp.planner.measure import measure_scaled, offload_rounding
from usp.planner.overheads import Overheads, overheads_for
from usp.planner.timing import comm_bytes, host_step_time, step_time  # noqa: F401
from usp.process_groups import valid_degree_pairs
from usp.process_groups.rank_math import RankMap, TopologyError
from usp.sp.sharding import required_multiple

GIB = 2**30
GB = 1e9

#: the memory levers the search tries, least recomputation first, as
#: ``(activation_checkpointing, mlp_tile_tokens, attention_head_chunks, offload)``;
#: :data:`EVERY_HEAD` chunks = one KV head per ring pass (as many as the grid's ring
#: attends to); ``offload``: what of the training state lives in host memory
#: (``"optimizer"``: AdamW's state and step, ``"parameters"``: also the parameter and
#: gradient shards; :class:`usp.models.Levers`). The loss chunk is the config's
#: (``Levers`` default), not searched.
EVERY_HEAD = "every head"
LEVER_STEPS: tuple[tuple[bool | str, int, int | str, str], ...] = (
    (False, 0, 1, "none"),
    (True, 0, 1, "none"),
    ("offload", 0, 1, "none"),
    (True, 8192, 1, "none"),
    ("offload", 8192, 1, "none"),
    ("offload", 8192, EVERY_HEAD, "none"),
    ("offload", 8192, EVERY_HEAD, "optimizer"),
    ("offload", 8192, EVERY_HEAD, "parameters"),
)
_OFFLOAD = {"none": {}, "optimizer": {"offload_optimizer": True},
            "parameters": {"offload_optimizer": True, "offload_parameters": True}}  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    host_memory_gib: float  # per node
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    gpu: str = DEFAULT_GPU  # the GPU's name (NVSwitch nodes: NCCL's NVLS buffers)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Candidate:
    """One layout at one sequence length, measured and timed."""

    choice: Choice
    seq_len: int
    footprint: Footprint
    fits: bool
    why_not: str | None
    step_time_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)
    overheads: Overheads | None = None  # what the device and the host spend besides

    @property
    def peak_device_gib(self) -> float:
        """The measured step's device peak (the tensors; :attr:`device_total_gib` adds
        the named items)."""
        return self.footprint.peak_device / GIB

    @property
    def peak_host_gib(self) -> float:
        """A rank's host tensors, pinned rounding included."""
        return self.footprint.host_total / GIB

    @property
    def device_total_gib(self) -> float:
        """The measured peak plus every item added to it (what the GPU must hold)."""
        if self.overheads is None:
            return self.peak_device_gib
        return (
            self.overheads.budget(self.footprint.extras).device_total(self.footprint.peak_device)
            / GIB
        )

    def items(self):
        """The named lines of :mod:`usp.planner.overheads` for this candidate."""
        if self.overheads is None:
            return []
        return self.overheads.items(self.footprint.peak_device, self.footprint.extras)


# ----------------------------------------------------------------------------- candidates
def lever_options(model, grid: tuple[int, int, int], ranks_per_node: int) -> list[Levers]:
    """The :data:`LEVER_STEPS` for one ``(ulysses, ring, dp)`` grid, as
    :class:`usp.models.Levers` (a step equal to an earlier one, head chunks that equal
    the previous step's, is left out)."""
    u, r, _ = grid
    local = kv_heads_per_ring(
        model.num_attention_heads, model.num_key_value_heads, u, u * r, ranks_per_node
    )
    tiles = tiles_mlp(model)
    options: list[Levers] = []
    for checkpointing, tile, chunks, offload in LEVER_STEPS:
        tile = tile if tiles else 0
        chunks = local if chunks == EVERY_HEAD else chunks
        levers = Levers(checkpointing, tile, chunks, **_OFFLOAD[offload])
        if levers not in options:
            options.append(levers)
    return options


def tiles_mlp(config) -> bool:
    """Whether the model's MLPs take ``mlp_tile_tokens`` (every usp family's: SwiGLU,
    GeGLU, experts): asked of one layer built on the meta device."""
    with torch.device("meta"):
        model = family_of(config).build(config.replace(num_hidden_layers=1))
    try:
        Levers(mlp_tile_tokens=1).check(model)
    except LeverError:
        return False
    return True


def grids(model, cluster: Cluster, job) -> list[tuple[int, int, int]]:
    """Every ``(ulysses, ring, dp)`` the heads, the nodes and the batch allow."""
    parallel = job.topology.parallel
    world = cluster.world_size
    found = []
    for dp in (d for d in range(1, world + 1) if world % d == 0):
        sp = world // dp
        pairs = valid_degree_pairs(model.num_attention_heads, model.num_key_value_heads, sp)
        for u, r in pairs:
            try:
                RankMap(
                    world, cluster.gpus_per_node, u, r, dp, parallel.placement,
                    parallel.allow_cross_node_ulysses,
                )  # fmt: skip
                job.gradient_accumulation(dp)
            except (TopologyError, ConfigError):
                continue
            found.append((u, r, dp))
    return found


def choices(model, cluster: Cluster, job) -> list[Choice]:
    return [
        Choice(u, r, dp, levers)
        for u, r, dp in grids(model, cluster, job)
        for levers in lever_options(model, (u, r, dp), cluster.gpus_per_node)
    ]


def sequence_multiple(choice: Choice, job) -> int:
    """Every sequence length a layout serves is a multiple of this."""
    return required_multiple(choice.ring, choice.ulysses, job.topology.attention.layout)


# ----------------------------------------------------------------------------- fitting
def overheads(target: Target, choice: Choice, cluster: Cluster) -> Overheads:
    """What a rank of ``layout`` spends besides its measured step (:mod:`usp.planner.
    overheads`: NCCL communicators, CUDA context, allocator reserve, margin, host)."""
    return overheads_for(
        device=target.device, gpu=cluster.gpu, gpu_memory_gib=cluster.gpu_memory_gib,
        host_memory_gib=cluster.host_memory_gib, ranks_per_node=cluster.gpus_per_node,
        ulysses=choice.ulysses, ring=choice.ring, dp=choice.dp,
        nvswitch=cluster.gpu in NVSWITCH_GPUS,
    )  # fmt: skip


def judge(footprint: Footprint, costs: Overheads) -> tuple[bool, str | None]:
    """Whether a footprint fits the device (its peak plus every item of ``costs``) and
    the host (every rank of a node together, with the node's reserve), and if not, why."""
    budget = costs.budget(footprint.extras)
    device = budget.device_total(footprint.peak_device) / GIB
    host = budget.host_total(footprint.host_total) / GIB
    if footprint.peak_device > budget.device_peak_limit:
        return False, (
            f"device {device:.1f} GiB (step {footprint.peak_device / GIB:.1f} + overheads) > "
            f"{budget.gpu_bytes / GIB:.1f} GiB"
        )
    if footprint.host_total > budget.host_peak_limit:
        return False, f"host {host:.1f} GiB per node > {budget.host_bytes / GIB:.0f} GiB"
    return True, None


def target_at(target: Target, seq_len: int) -> Target:
    return target.at(seq_len)


class _DictCache:
    """A plain dict as ``measured`` (what :func:`evaluate` and :func:`max_seq_len` took
    before :class:`usp.planner.pool.Measurements`): measured in process when first
    asked, kept in the dict by ``(layout, seq_len)``."""

    jobs = 1

    def __init__(self, target: Target, cache: dict) -> None:
        self.target, self.cache = target, cache

    def want(self, choice: Choice, seq_len: int, *, urgent: bool = False) -> None:
        pass  # (nothing runs ahead in process)

    def footprint(self, choice: Choice, seq_len: int) -> Footprint:
        return _footprint_at(self.target, choice, self.cache, seq_len)


def _footprint_at(target: Target, choice: Choice, cache: dict, seq_len: int) -> Footprint:
    key = (choice, seq_len)
    if key not in cache:
        cache[key] = measure_scaled(target.at(seq_len), choice)
    return cache[key]


def _measurements(measured, target: Target):
    return _DictCache(target, measured) if isinstance(measured, dict) else measured


def evaluate(target: Target, choice: Choice, cluster: Cluster, measured) -> Candidate:
    """One layout at the target's sequence length (``measured``: the plan's
    :class:`usp.planner.pool.Measurements`, or a dict to cache in)."""
    footprint = _measurements(measured, target).footprint(choice, target.seq_len)
    costs = overheads(target, choice, cluster)
    fits, why = judge(footprint, costs)
    sent = comm_bytes(target, choice)
    seconds = step_time(target, choice, cluster, sent)
    return Candidate(choice, target.seq_len, footprint, fits, why, seconds, sent, costs)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting ones first, fastest first; then the rest by device memory."""
    return sorted(
        candidates,
        key=lambda c: (not c.fits, c.step_time_s if c.fits else c.footprint.peak_device),
    )


#: grids whose longest sequence is searched (those with the least memory per rank)
FRONTIER = 2


def max_seq_len(
    target: Target, layouts_: list[Choice], cluster: Cluster, measured, *, rounds: int = 4
) -> tuple[int, Choice | None]:
    """The longest sequence (a multiple of what the layout needs, at most
    :func:`longest_plannable`) that some layout fits, and that layout. Each layout's
    device and host peaks grow close to linearly with the sequence: a line through two
    measured lengths predicts its longest fit within both limits (its budget:
    :func:`overheads`), the best prediction is measured, and a new line through the
    longest measured fit and the shortest measured miss (a secant step) predicts again,
    until a measured length fits and the next multiple does not, or ``rounds``
    measurements are spent (then the longest measured fit is returned). ``measured``:
    the plan's :class:`usp.planner.pool.Measurements`, or a dict to cache in."""
    measured = _measurements(measured, target)
    best_len, best_layout, predictions = 0, None, []
    frontier = [
        (lay, _line_lengths(lay, target)) for lay in _frontier(layouts_, target, cluster, measured)
    ]
    for choice, lengths in reversed(frontier):  # every line's points, before any wait
        for s in reversed(lengths):
            measured.want(choice, s, urgent=True)
    for choice, lengths in frontier:
        multiple = sequence_multiple(choice, target.job)
        costs = overheads(target, choice, cluster)
        points = [(s, measured.footprint(choice, s)) for s in lengths]
        cap = longest_plannable(target, multiple)
        rounding = _rounding(target, choice)
        predicted = min(cap, _predict(points, costs, multiple, rounding))
        predictions.append((predicted, choice, multiple, costs))
        for s, footprint in points:
            if judge(footprint, costs)[0] and s > best_len:
                best_len, best_layout = s, choice
    predictions.sort(key=lambda p: -p[0])
    for predicted, choice, multiple, costs in predictions[:1]:
        cap = longest_plannable(target, multiple)
        points = {s: measured.footprint(choice, s) for s in _line_lengths(choice, target)}
        length = predicted

        def fits(s: int) -> bool:
            return judge(points[s], costs)[0]  # noqa: B023 (this layout's points)

        for _ in range(rounds):
            fitting = max((s for s in points if fits(s)), default=0)
            failing = min((s for s in points if not fits(s)), default=None)
            if failing is not None:
                length = min(length, failing - multiple)
            if length <= max(fitting, best_len) or length < multiple:
                break  # the boundary is between two measured lengths a multiple apart
            above = length + multiple
            if measured.jobs > 1 and above <= cap:  # a free worker measures it meanwhile
                measured.want(choice, above, urgent=True)
            points[length] = measured.footprint(choice, length)
            if fits(length):
                best_len, best_layout = length, choice
                if above > cap:
                    break  # the longest the search can represent fits
                points[above] = measured.footprint(choice, above)
                if not fits(above):
                    break  # measured: this length fits and the next multiple does not
            nearest = _nearest(points, costs)
            length = min(cap, _predict(nearest, costs, multiple, _rounding(target, choice)))
    return best_len, best_layout


def _rounding(target: Target, choice: Choice):
    """The pinned rounding of the layout's offloaded layer inputs at a length."""
    layers = target.model.num_hidden_layers
    return lambda seq_len: offload_rounding(target, choice, seq_len, layers)


def longest_plannable(target: Target, multiple: int) -> int:
    """The longest sequence the search measures: the packed row (``micro_batch`` x the
    sequence) within :data:`usp.planner.hardware.MAX_ROW_TOKENS`, a multiple of
    ``multiple``."""
    return MAX_ROW_TOKENS // target.job.train.micro_batch // multiple * multiple


def _line_lengths(choice: Choice, target: Target) -> tuple[int, int]:
    """The two lengths a layout's line is drawn through: the planned one and about half
    (or twice it, within :func:`longest_plannable`, when half is the same)."""
    base = target.seq_len
    multiple = sequence_multiple(choice, target.job)
    lengths = (base, max(multiple, base // 2 // multiple * multiple))
    if lengths[1] != lengths[0]:
        return lengths
    return (base, min(base * 2, max(base + multiple, longest_plannable(target, multiple))))


def frontier_candidates(layouts_: list[Choice]) -> list[Choice]:
    """The layouts :func:`_frontier` chooses from: dp = 1 (a replica of fewer ranks
    holds more tokens per rank), each grid with its most memory-saving activation option
    (the last accepted) for each training-state offload (none, the optimizer's, the
    parameters'): offloading saves device memory and costs host memory, so which one
    reaches further depends on which limit binds."""
    best: dict[tuple[int, int, str], Choice] = {}
    for choice in layouts_:
        if choice.dp == 1:
            best[(choice.ulysses, choice.ring, choice.levers.offload)] = choice
    return list(best.values())


def _frontier(layouts_: list[Choice], target: Target, cluster: Cluster, measured) -> list[Choice]:
    """The layouts worth extending: of :func:`frontier_candidates`, the :data:`FRONTIER`
    that fill their budget least at the planned length (the larger of the device peak's
    and the host's share of their limits: both grow about linearly with the sequence)."""
    candidates = frontier_candidates(layouts_)
    for choice in reversed(candidates):  # urgent: the first ends up first
        measured.want(choice, target.seq_len, urgent=True)

    def fill(choice: Choice) -> float:
        footprint = measured.footprint(choice, target.seq_len)
        budget = overheads(target, choice, cluster).budget(footprint.extras)
        host = footprint.host_total / max(budget.host_peak_limit, 1.0)
        return max(footprint.peak_device / max(budget.device_peak_limit, 1.0), host)

    return sorted(candidates, key=fill)[:FRONTIER]


def _predict(points, costs: Overheads, multiple: int, rounding=None) -> int:
    """The longest multiple of ``multiple`` that the line through two measured points
    keeps within both limits of the layout's budget: the device peak's (the GPU less
    every item, :mod:`usp.planner.overheads`) and a rank's host share (the node's
    memory less its reserve, over its ranks, less each rank's process). ``rounding``:
    the pinned rounding of offloaded layer inputs at a length (:func:`usp.planner.
    measure.offload_rounding`), a step function -- each rounded piece jumps to the next
    power of two --, so the host's line is drawn without it and it is added back
    exactly."""
    (s0, f0), (s1, f1) = points
    budget = costs.budget(f1.extras)
    lengths = []
    slope = (f1.peak_device - f0.peak_device) / (s1 - s0)
    if slope > 0:
        lengths.append(s0 + (budget.device_peak_limit - f0.peak_device) / slope)
    host_len = _host_length(points, budget.host_peak_limit, multiple, rounding or (lambda s: 0))
    if host_len is not None:
        lengths.append(host_len)
    if not lengths:
        return max(s0, s1)
    return max(0, math.floor(min(lengths) / multiple) * multiple)


def _host_length(points, limit: float, multiple: int, rounding) -> float | None:
    """The longest multiple within the host limit: the line through the host peaks
    less their rounding, plus the rounding at each length (never decreasing: found by
    bisection); None when the host does not grow."""
    (s0, f0), (s1, f1) = points
    h0, h1 = f0.host_total - rounding(s0), f1.host_total - rounding(s1)
    slope = (h1 - h0) / (s1 - s0)
    if slope <= 0:
        return None

    def host(s: int) -> float:
        return h0 + slope * (s - s0) + rounding(s)

    lo, hi = 0, max(0, math.floor((s0 + (limit - h0) / slope) / multiple))  # (rounding >= 0)
    while lo < hi:  # the largest k with host(k * multiple) <= limit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if host(mid * multiple) <= limit else (lo, mid - 1)
    return float(lo * multiple)


def _nearest(points: dict, costs: Overheads) -> list:
    """The two measured points a new line goes through: the longest that fits and the
    shortest that does not when both exist (the boundary lies between them), else the
    two longest."""
    fitting = sorted(s for s, f in points.items() if judge(f, costs)[0])
    failing = sorted(s for s, f in points.items() if not judge(f, costs)[0])
    if fitting and failing:
        chosen = (fitting[-1], failing[0])
    elif len(fitting) >= 2:
        chosen = tuple(fitting[-2:])
    else:
        chosen = tuple(failing[:2])
    return [(s, points[s]) for s in chosen]

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

from usp.config import ConfigError
from usp.models import Levers, model_counts
from usp.planner.footprint import Footprint, Layout, Target
from usp.planner.kernels import planning_backend
from usp.planner.measure import measure_scaled
from usp.planner.traffic import fsdp_traffic, step_traffic, traffic_formula

GIB = 2**30
GB = 1e9

#: the memory levers the search tries, least recomputation first, as
#: ``(activation_checkpointing, mlp_tile_tokens, attention_head_chunks)``;
#: :data:`EVERY_HEAD` chunks = one KV head per ring pass (as many as the grid's ring
#: attends to). The loss chunk is the config's (``Levers`` default), not searched.
EVERY_HEAD = "every head"
LEVER_STEPS: tuple[tuple[bool | str, int, int | str], ...] = (
    (False, 0, 1),
    (True, 0, 1),
    ("offload", 0, 1),
    (True, 8192, 1),
    ("offload", 8192, 1),
    ("offload", 8192, EVERY_HEAD),
)

#: the part of a device's memory a plan may use: the rest is for the CUDA context, the
#: kernels' workspaces and the caching allocator's fragmentation
USABLE_FRACTION = 0.9
#: device memory in GiB by GPU name (``[cluster] gpu``); what ``nvidia-smi`` reports
GPU_MEMORY_GIB = {"H200": 140.0, "H100": 79.6, "A100": 79.2}
DEFAULT_GPU = "H200"
#: host memory per node in GiB when neither the config nor the command line says
DEFAULT_HOST_MEMORY_GIB = 2048.0
#: link bandwidths in GB/s (1e9 bytes/s) per direction, when the config does not say:
#: NVLink 4 on H100/H200 (~450 GB/s measured per direction of the 900 GB/s total) and
#: one 400 Gb/s InfiniBand NIC per GPU (50 GB/s)
DEFAULT_INTRA_NODE_GBPS = 450.0
DEFAULT_INTER_NODE_GBPS = 50.0

#: TFLOP/s per attention backend, forward + backward, causal, bf16 (H200 measurements
#: of shared/DESIGN.md, at 128k tokens; flash_attn assumed equal to torch's FA2)
ATTENTION_TFLOPS = {"cudnn": 542.0, "flash": 325.0, "flash_attn": 325.0, "efficient": 144.0}
#: the matmuls (projections, MLP, output head) in bf16 on an H200: an assumption (two
#: thirds of the 989 TFLOP/s dense peak, what large cuBLAS GEMMs reach), not measured here
GEMM_TFLOPS = 660.0
#: every kernel on a CPU device: a rough figure, not measured (CPU plans are for demos)
CPU_TFLOPS = 0.5


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    host_memory_gib: float  # per node
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Candidate:
    """One layout at one sequence length, measured and timed."""

    layout: Layout
    seq_len: int
    footprint: Footprint
    fits: bool
    why_not: str | None
    step_time_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def peak_device_gib(self) -> float:
        return self.footprint.peak_device / GIB

    @property
    def peak_host_gib(self) -> float:
        return self.footprint.peak_host / GIB


# ----------------------------------------------------------------------------- candidates
def lever_options(model, grid: tuple[int, int, int], ranks_per_node: int) -> list[Levers]:
    """The :data:`LEVER_STEPS` for one ``(ulysses, ring, dp)`` grid, as
    :class:`usp.models.Levers` (a step whose head chunks equal the previous step's is
    left out)."""
    from usp.models.plans import kv_heads_per_ring

    u, r, _ = grid
    local = kv_heads_per_ring(
        model.num_attention_heads, model.num_key_value_heads, u, u * r, ranks_per_node
    )
    options: list[Levers] = []
    for checkpointing, tile, chunks in LEVER_STEPS:
        levers = Levers(checkpointing, tile, local if chunks == EVERY_HEAD else chunks)
        if levers not in options:
            options.append(levers)
    return options


def grids(model, cluster: Cluster, job) -> list[tuple[int, int, int]]:
    """Every ``(ulysses, ring, dp)`` the heads, the nodes and the batch allow."""
    from usp.process_groups import valid_degree_pairs
    from usp.process_groups.rank_math import RankMap, TopologyError

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


def layouts(model, cluster: Cluster, job) -> list[Layout]:
    return [
        Layout(u, r, dp, levers)
        for u, r, dp in grids(model, cluster, job)
        for levers in lever_options(model, (u, r, dp), cluster.gpus_per_node)
    ]


def sequence_multiple(layout: Layout, job) -> int:
    """Every sequence length a layout serves is a multiple of this."""
    from usp.sharding import required_multiple

    return required_multiple(layout.ring, layout.ulysses, job.topology.attention.layout)


# ----------------------------------------------------------------------------- time
def _spans_nodes(members, ranks_per_node: int) -> bool:
    return len({m // ranks_per_node for m in members}) > 1


def comm_bytes(target: Target, layout: Layout) -> dict[str, int]:
    """Bytes one rank sends per step, by kind (:mod:`usp.planner.traffic`)."""
    model, job = target.model, target.job
    compute = 2 if target.device == "cuda" else 4
    heads = _Heads(model.num_attention_heads, model.num_key_value_heads, model.attention_head_dim)
    row = job.train.micro_batch * job.train.seq_len
    attention = traffic_formula(
        heads, batch=1, seqlen=row, ulysses=layout.ulysses, ring=layout.ring,
        ring_impl=job.topology.attention.ring_impl, item_bytes=compute, acc_bytes=4,
    )  # fmt: skip
    counts = model_counts(model)
    per_layer, other = counts.per_layer, counts.other
    fsdp = fsdp_traffic(
        per_layer, other, model.num_hidden_layers, world=target.world_size,
        compute_bytes=compute, reduce_bytes=4,
    )  # fmt: skip
    return step_traffic(
        attention,
        fsdp,
        layers=model.num_hidden_layers,
        micro_batches=job.gradient_accumulation(layout.dp),
        recompute=bool(layout.levers.activation_checkpointing),
    )


@dataclass(frozen=True)
class _Heads:
    heads: int
    kv_heads: int
    head_dim: int


def step_time(target: Target, layout: Layout, cluster: Cluster, sent: dict[str, int]) -> float:
    """Estimated seconds per optimizer step on one rank: FLOPs at the kernels'
    throughput plus communication over the links. Matmuls (x4/3 with activation
    checkpointing's recompute, x1 + 2/3 more for a tiled MLP's) overlap FSDP's
    collectives (prefetch); attention overlaps the p2p ring (double buffering); the
    Ulysses all-to-alls and the allgather ring's collectives are serial."""
    model, job = target.model, target.job
    counts = model_counts(model)
    row = job.train.micro_batch * job.train.seq_len
    rows = job.gradient_accumulation(layout.dp)
    sp = layout.sp
    gemm = 6 * counts.matmul * row * rows / sp
    attention = counts.attention_flops(row * row) * rows / sp
    if layout.levers.activation_checkpointing:
        gemm, attention = gemm * 4 / 3, attention * 4 / 3
    if layout.levers.mlp_tile_tokens:
        gemm *= 1.2  # the MLP's forward once more (it is ~2/3 of a layer's matmuls)
    if target.device == "cuda":
        backend = planning_backend("cuda", job.topology.attention.backend)
        gemm_s = gemm / (GEMM_TFLOPS * 1e12)
        attention_s = attention / (ATTENTION_TFLOPS.get(backend, 144.0) * 1e12)
    else:
        gemm_s, attention_s = gemm / (CPU_TFLOPS * 1e12), attention / (CPU_TFLOPS * 1e12)
    links = _links(layout, cluster, job)
    seconds = {kind: sent.get(kind, 0) / (links[kind] * GB) for kind in links}
    exposed = seconds["attention_all_to_all"] + seconds["attention_all_gather"]
    exposed += seconds["attention_reduce_scatter"]
    return (
        max(gemm_s, seconds["fsdp_all_gather"] + seconds["fsdp_reduce_scatter"])
        + max(attention_s, seconds["attention_p2p"])
        + exposed
    )


def _links(layout: Layout, cluster: Cluster, job) -> dict[str, float]:
    """GB/s of the link each kind crosses for rank 0: a group that spans nodes is bound
    by its inter-node hop."""
    from usp.process_groups.rank_math import RankMap

    parallel = job.topology.parallel
    n = cluster.gpus_per_node
    rank_map = RankMap(
        cluster.world_size, n, layout.ulysses, layout.ring, layout.dp, parallel.placement,
        parallel.allow_cross_node_ulysses,
    )  # fmt: skip

    def speed(members) -> float:
        return cluster.inter_node_gbps if _spans_nodes(members, n) else cluster.intra_node_gbps

    ring = speed(rank_map.ring_group_of(0))
    fsdp = speed(range(cluster.world_size))
    return {
        "attention_all_to_all": speed(rank_map.ulysses_group_of(0)),
        "attention_p2p": ring,
        "attention_all_gather": ring,
        "attention_reduce_scatter": ring,
        "fsdp_all_gather": fsdp,
        "fsdp_reduce_scatter": fsdp,
    }


# ----------------------------------------------------------------------------- fitting
def judge(footprint: Footprint, cluster: Cluster) -> tuple[bool, str | None]:
    """Whether a footprint fits the device (:data:`USABLE_FRACTION` of it) and the
    host (every rank of a node together), and if not, why."""
    device_limit = cluster.gpu_memory_gib * USABLE_FRACTION
    device = footprint.peak_device / GIB
    host = footprint.peak_host / GIB * cluster.gpus_per_node
    if device > device_limit:
        return False, f"device {device:.1f} GiB > {device_limit:.1f} GiB usable"
    if host > cluster.host_memory_gib:
        return False, f"host {host:.1f} GiB per node > {cluster.host_memory_gib:.0f} GiB"
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

    def want(self, layout: Layout, seq_len: int, *, urgent: bool = False) -> None:
        pass  # (nothing runs ahead in process)

    def footprint(self, layout: Layout, seq_len: int) -> Footprint:
        return _footprint_at(self.target, layout, self.cache, seq_len)


def _footprint_at(target: Target, layout: Layout, cache: dict, seq_len: int) -> Footprint:
    key = (layout, seq_len)
    if key not in cache:
        cache[key] = measure_scaled(target.at(seq_len), layout)
    return cache[key]


def _measurements(measured, target: Target):
    return _DictCache(target, measured) if isinstance(measured, dict) else measured


def evaluate(target: Target, layout: Layout, cluster: Cluster, measured) -> Candidate:
    """One layout at the target's sequence length (``measured``: the plan's
    :class:`usp.planner.pool.Measurements`, or a dict to cache in)."""
    footprint = _measurements(measured, target).footprint(layout, target.seq_len)
    fits, why = judge(footprint, cluster)
    sent = comm_bytes(target, layout)
    return Candidate(
        layout, target.seq_len, footprint, fits, why, step_time(target, layout, cluster, sent), sent
    )


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting ones first, fastest first; then the rest by device memory."""
    return sorted(
        candidates,
        key=lambda c: (not c.fits, c.step_time_s if c.fits else c.footprint.peak_device),
    )


#: grids whose longest sequence is searched (those with the least memory per rank)
FRONTIER = 2


def max_seq_len(
    target: Target, layouts_: list[Layout], cluster: Cluster, measured, *, rounds: int = 4
) -> tuple[int, Layout | None]:
    """The longest sequence (a multiple of what the layout needs) that some layout fits,
    and that layout. Each layout's device and host peaks grow close to linearly with
    the sequence: a line through two measured lengths predicts its longest fit within
    both limits, the best prediction is measured, and a new line through the longest
    measured fit and the shortest measured miss (a secant step) predicts again, until a
    measured length fits and the next multiple does not, or ``rounds`` measurements
    are spent (then the longest measured fit is returned). ``measured``: the plan's
    :class:`usp.planner.pool.Measurements`, or a dict to cache in."""
    measured = _measurements(measured, target)
    best_len, best_layout, predictions = 0, None, []
    frontier = [(lay, _line_lengths(lay, target)) for lay in _frontier(layouts_, target, measured)]
    for layout, lengths in reversed(frontier):  # every line's points, before any wait
        for s in reversed(lengths):
            measured.want(layout, s, urgent=True)
    for layout, lengths in frontier:
        multiple = sequence_multiple(layout, target.job)
        points = [(s, measured.footprint(layout, s)) for s in lengths]
        predictions.append((_predict(points, cluster, multiple), layout, multiple))
        for s, footprint in points:
            if judge(footprint, cluster)[0] and s > best_len:
                best_len, best_layout = s, layout
    predictions.sort(key=lambda p: -p[0])
    for predicted, layout, multiple in predictions[:1]:
        points = {s: measured.footprint(layout, s) for s in _line_lengths(layout, target)}
        length = predicted
        for _ in range(rounds):
            fitting = max((s for s, f in points.items() if judge(f, cluster)[0]), default=0)
            failing = min((s for s, f in points.items() if not judge(f, cluster)[0]), default=None)
            if failing is not None:
                length = min(length, failing - multiple)
            if length <= max(fitting, best_len) or length < multiple:
                break  # the boundary is between two measured lengths a multiple apart
            if measured.jobs > 1:  # a free worker measures the next multiple meanwhile
                measured.want(layout, length + multiple, urgent=True)
            points[length] = measured.footprint(layout, length)
            if judge(points[length], cluster)[0]:
                best_len, best_layout = length, layout
                above = length + multiple
                points[above] = measured.footprint(layout, above)
                if not judge(points[above], cluster)[0]:
                    break  # measured: this length fits and the next multiple does not
            length = _predict(_nearest(points, cluster), cluster, multiple)
    return best_len, best_layout


def _line_lengths(layout: Layout, target: Target) -> tuple[int, int]:
    """The two lengths a layout's line is drawn through: the planned one and about half."""
    base = target.seq_len
    multiple = sequence_multiple(layout, target.job)
    lengths = (base, max(multiple, base // 2 // multiple * multiple))
    return (base, base * 2) if lengths[1] == lengths[0] else lengths


def frontier_candidates(layouts_: list[Layout]) -> list[Layout]:
    """The layouts :func:`_frontier` chooses from: dp = 1 (a replica of fewer ranks
    holds more tokens per rank), each grid with its most memory-saving option (the last
    accepted)."""
    best: dict[tuple[int, int], Layout] = {}
    for layout in layouts_:
        if layout.dp == 1:
            best[(layout.ulysses, layout.ring)] = layout
    return list(best.values())


def _frontier(layouts_: list[Layout], target: Target, measured) -> list[Layout]:
    """The layouts worth extending: of :func:`frontier_candidates`, the
    :data:`FRONTIER` with the least memory at the planned length."""
    candidates = frontier_candidates(layouts_)
    for layout in reversed(candidates):  # urgent: the first ends up first
        measured.want(layout, target.seq_len, urgent=True)

    def peak(layout: Layout) -> int:
        return measured.footprint(layout, target.seq_len).peak_device

    return sorted(candidates, key=peak)[:FRONTIER]


def _predict(points, cluster: Cluster, multiple: int) -> int:
    """The longest multiple of ``multiple`` that the line through two measured points
    keeps within both limits: the device's (:data:`USABLE_FRACTION` of it) and the
    host's share of one rank (a node's host memory over its ranks)."""
    (s0, f0), (s1, f1) = points
    limits = (
        (cluster.gpu_memory_gib * USABLE_FRACTION * GIB, lambda f: f.peak_device),
        (cluster.host_memory_gib * GIB / cluster.gpus_per_node, lambda f: f.peak_host),
    )
    lengths = []
    for limit, peak in limits:
        slope = (peak(f1) - peak(f0)) / (s1 - s0)
        if slope > 0:
            lengths.append(s0 + (limit - peak(f0)) / slope)
    if not lengths:
        return max(s0, s1)
    return max(0, math.floor(min(lengths) / multiple) * multiple)


def _nearest(points: dict, cluster: Cluster) -> list:
    """The two measured points a new line goes through: the longest that fits and the
    shortest that does not when both exist (the boundary lies between them), else the
    two longest."""
    fitting = sorted(s for s, f in points.items() if judge(f, cluster)[0])
    failing = sorted(s for s, f in points.items() if not judge(f, cluster)[0])
    if fitting and failing:
        chosen = (fitting[-1], failing[0])
    elif len(fitting) >= 2:
        chosen = tuple(fitting[-2:])
    else:
        chosen = tuple(failing[:2])
    return [(s, points[s]) for s in chosen]

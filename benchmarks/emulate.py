"""Emulate one rank of a large sequence-parallel job on one device, and account every byte.

    python benchmarks/emulate.py [--out results/]                      # the default sweep
    python benchmarks/emulate.py --preset llama3-70b --seqlen 1048576 --world 64 --grids 8x8

PyTorch's ``fake`` process-group backend lets this process act as rank k of a world of
any size: collectives return at once with the right shapes (received buffers hold
garbage, which does not change kernel time). Running the real ``usp_attention`` forward
and backward under it times exactly one rank's compute path (kernels, merges, packing
copies) and its peak memory; the byte counters of ``Topology.comm_stats`` give its
traffic per collective kind, which a link-bandwidth model turns into time. Nothing here
measures real communication or its contention with compute.

Efficiency is the ideal time over the measured per-rank time, the ideal being a
monolithic (single-device, whole-sequence) ``attention_forward`` + ``attention_backward``
of the same kernel backend divided by the sequence-parallel size P; it is also given
against FA2 (``flash``) monolithic / P. FLOPs count the visible part of the score matrix
(causal: half): forward 4*B*H*S^2*D (/2), backward 2.5x forward.

Default sweep (Llama-3-8B heads, bf16, causal, cuDNN): 128k tokens on 8 ranks for every
(ulysses, ring) grid, and 1M tokens on 64 ranks at (8, 8); both layouts, both ring
implementations. On CPU the default is a tiny preset at a few hundred tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import usp
from usp.kernels import BackendUnavailableError
from usp.planner.traffic import traffic_formula  # the one definition (tests use it from here)
from usp.process_groups import kv_replication, valid_degree_pairs
from usp.process_groups.fake import fake_world
from usp.process_groups.rank_math import RankMap

GB = 1e9  # link bandwidths are quoted in GB/s = 1e9 bytes/s
GIB = 2**30
RING_KINDS = ("p2p", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int


PRESETS = {
    "tiny": AttentionShape(heads=8, kv_heads=2, head_dim=16),
    "llama3-8b": AttentionShape(heads=32, kv_heads=8, head_dim=128),
    "llama3-70b": AttentionShape(heads=64, kv_heads=8, head_dim=128),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Config:
    """One emulated configuration; ``seqlen`` is the sequence of one SP replica."""

    preset: str
    seqlen: int
    world: int
    ulysses: int
    ring: int
    layout: str
    ring_impl: str
    backend: str
    causal: bool
    batch: int
    dtype: str
    ranks_per_node: int

    @property
    def shape(self) -> AttentionShape:
        return PRESETS[self.preset]

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def local_len(self) -> int:
        return self.seqlen // self.sp

    def label(self) -> str:
        impl = self.ring_impl if self.ring > 1 else "-"
        return (
            f"{self.preset} S={self.seqlen} P={self.world} u{self.ulysses}xr{self.ring} "
            f"{self.layout} {impl} {self.backend}"
        )


@dataclass(frozen=True)
class Options:
    """How to measure (shared by every configuration of a run)."""

    device: torch.device
    warmup: int
    repeats: int
    rank: int | None
    intra_gbps: float
    inter_gbps: float
    max_monolithic_tokens: int


# ------------------------------------------------------------------ FLOPs and traffic
def attention_flops(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool) -> float:
    """Forward + backward FLOPs of attention over the whole sequence (backward = 2.5x forward)."""
    forward = 4 * batch * heads * seqlen * seqlen * head_dim
    return 3.5 * (forward / 2 if causal else forward)


def bytes_ratio(measured: dict, formula: dict) -> float:
    """Total bytes sent + received, measured over formula (1.0 when they agree)."""

    def total(traffic):
        return sum(c["sent"] + c["received"] for p in traffic.values() for c in p.values())

    expected = total(formula)
    return total(measured) / expected if expected else (1.0 if total(measured) == 0 else math.inf)


# ------------------------------------------------------------------ which rank, which link
def emulated_rank(rank_map: RankMap, cfg: Config, requested: int | None) -> tuple[int, str]:
    """The global rank to emulate, and why: the slowest one unless one was requested."""
    if requested is not None:
        return requested, "requested with --rank"
    if cfg.causal and cfg.layout == "contiguous" and cfg.ring > 1:
        rank = rank_map.rank_of(0, cfg.ring - 1, 0)
        return rank, "slowest: the last ring rank does the most causal work (contiguous)"
    if cfg.ring == 1:
        return 0, "rank 0: no ring, every rank does the same work"
    reason = f"{cfg.layout}, causal" if cfg.causal else "not causal"
    return 0, f"rank 0: every ring rank does the same work ({reason})"


def work_share(cfg: Config, ring_rank: int) -> float:
    """This rank's attention work over the ideal 1/P share (contiguous causal: (2j+1)/r)."""
    if cfg.causal and cfg.layout == "contiguous":
        return (2 * ring_rank + 1) / cfg.ring
    return 1.0


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float


def _spans_nodes(members: list[int], ranks_per_node: int) -> bool:
    return len({m // ranks_per_node for m in members}) > 1


def links_of(rank_map: RankMap, rank: int, opts: Options) -> dict[str, Link]:
    """The link each collective kind crosses for ``rank``: a group that spans nodes is
    bound by its slowest (inter-node) hop; one inside a node uses NVLink-class links."""
    intra, inter = Link("intra-node", opts.intra_gbps), Link("inter-node", opts.inter_gbps)
    n = rank_map.ranks_per_node
    ulysses = inter if _spans_nodes(rank_map.ulysses_group_of(rank), n) else intra
    ring = inter if _spans_nodes(rank_map.ring_group_of(rank), n) else intra
    return {"all_to_all": ulysses, **{kind: ring for kind in RING_KINDS}}


def comm_ms(traffic: dict, links: dict[str, Link]) -> dict[str, dict[str, float]]:
    """Per pass and kind: max(sent, received) / link bandwidth, in ms (full duplex)."""
    return {
        phase: {
            kind: max(c["sent"], c["received"]) / (links[kind].gbps * GB) * 1e3
            for kind, c in kinds.items()
        }
        for phase, kinds in traffic.items()
    }


def modelled_pass_ms(compute_ms: float, kinds_ms: dict[str, float]) -> float:
    """Compute plus exposed communication: the all-to-alls are serial with the compute;
    p2p overlaps it (double buffering); the allgather ring's collectives do not."""
    exposed = kinds_ms.get("all_to_all", 0.0)
    exposed += max(0.0, kinds_ms.get("p2p", 0.0) - compute_ms)
    exposed += kinds_ms.get("all_gather", 0.0) + kinds_ms.get("reduce_scatter", 0.0)
    return compute_ms + exposed


# ------------------------------------------------------------------ measuring
def _mark(device: torch.device):
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds_between(marks: list, device: torch.device) -> list[float]:
    if device.type != "cuda":
        return [b - a for a, b in zip(marks, marks[1:])]
    torch.cuda.synchronize(device)
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def time_passes(
    forward: Callable[[], object],
    backward: Callable[[object], object],
    *,
    warmup: int,
    repeats: int,
    device: torch.device,
) -> dict[str, float]:
    """Median seconds of the forward, the backward and both, measured in the same
    iterations (CUDA events on a GPU, perf_counter on CPU) after ``warmup`` iterations."""
    for _ in range(warmup):
        backward(forward())
    samples: dict[str, list[float]] = {"forward": [], "backward": [], "forward_backward": []}
    for _ in range(repeats):
        marks = [_mark(device)]
        out = forward()
        marks.append(_mark(device))
        backward(out)
        marks.append(_mark(device))
        fwd, bwd = _seconds_between(marks, device)
        del out
        for key, value in (("forward", fwd), ("backward", bwd), ("forward_backward", fwd + bwd)):
            samples[key].append(value)
    return {key: statistics.median(values) for key, values in samples.items()}


def random_inputs(cfg: Config, seqlen: int, device: torch.device) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dout, [B, seqlen, heads, D]."""
    s, dtype = cfg.shape, DTYPES[cfg.dtype]
    q_shape = (cfg.batch, seqlen, s.heads, s.head_dim)
    kv_shape = (cfg.batch, seqlen, s.kv_heads, s.head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype).requires_grad_()
        for shape in (q_shape, kv_shape, kv_shape)
    )
    return [q, k, v, torch.randn(q_shape, device=device, dtype=dtype)]


def monolithic_seconds(cfg: Config, backend: str, seqlen: int, opts: Options) -> float:
    """Forward + backward of one kernel call over ``seqlen`` tokens on this device."""
    q, k, v, dout = (t.detach() for t in random_inputs(cfg, seqlen, opts.device))

    def forward():
        return usp.kernels.attention_forward(q, k, v, causal=cfg.causal, backend=backend)

    def backward(out_lse):
        out, lse = out_lse
        return usp.kernels.attention_backward(
            dout, q, k, v, out, lse, causal=cfg.causal, backend=backend
        )

    times = time_passes(
        forward, backward, warmup=opts.warmup, repeats=opts.repeats, device=opts.device
    )
    return times["forward_backward"]


def monolithic_reference(cfg: Config, backend: str, opts: Options) -> dict:
    """Monolithic time for ``cfg.seqlen``: measured at the full length, or at the largest
    power-of-two fraction that fits (memory, ``--max-monolithic-tokens``) and scaled by
    (S / measured)^2 (attention FLOPs are quadratic in S, causal or not)."""
    measured = cfg.seqlen
    while measured > opts.max_monolithic_tokens and measured % 2 == 0:
        measured //= 2
    while True:
        try:
            seconds = monolithic_seconds(cfg, backend, measured, opts)
            break
        except BackendUnavailableError as err:
            return {"backend": backend, "ms": None, "note": f"{backend} unavailable: {err}"}
        except torch.cuda.OutOfMemoryError:
            if measured % 2 or measured <= 1024:
                raise
            measured //= 2
            torch.cuda.empty_cache()
    scale = (cfg.seqlen / measured) ** 2
    note = (
        f"{backend} measured at full length {measured}"
        if measured == cfg.seqlen
        else f"{backend} measured at {measured} tokens, scaled x{scale:g} (quadratic) to {cfg.seqlen}"
    )
    return {
        "backend": backend,
        "ms": seconds * scale * 1e3,
        "measured_tokens": measured,
        "note": note,
    }


def accounted_bytes(cfg: Config) -> dict[str, int]:
    """What one rank must hold: inputs, output, gradients and two in-flight K/V blocks."""
    s, item = cfg.shape, DTYPES[cfg.dtype].itemsize
    q = cfg.batch * cfg.local_len * s.heads * s.head_dim * item
    kv = cfg.batch * cfg.local_len * s.kv_heads * s.head_dim * item
    ring_kv_heads = s.kv_heads * kv_replication(s.heads, s.kv_heads, cfg.ulysses) // cfg.ulysses
    block = 2 * cfg.batch * (cfg.seqlen // cfg.ring) * ring_kv_heads * s.head_dim * item
    parts = {
        "q,k,v": q + 2 * kv,
        "out": q,
        "dout": q,
        "dq,dk,dv": q + 2 * kv,
        "2 K/V ring blocks": 2 * block if cfg.ring > 1 else 0,
    }
    return {**parts, "total": sum(parts.values())}


def measure_rank(cfg: Config, topo: usp.process_groups.Topology, opts: Options) -> dict:
    """Time, traffic and peak memory of this rank's usp_attention forward + backward."""
    q, k, v, dout = random_inputs(cfg, cfg.local_len, opts.device)
    kwargs = {
        "causal": cfg.causal,
        "layout": cfg.layout,
        "ring_impl": cfg.ring_impl,
        "backend": cfg.backend,
    }

    def forward():
        return usp.usp_attention(q, k, v, topo, **kwargs)

    def backward(out):
        return torch.autograd.grad(out, (q, k, v), dout)

    times = time_passes(
        forward, backward, warmup=opts.warmup, repeats=opts.repeats, device=opts.device
    )
    topo.comm_stats.reset()
    out = forward()
    traffic = {"forward": topo.comm_stats.snapshot()}
    topo.comm_stats.reset()
    torch.autograd.grad(out, (q, k, v), dout)
    traffic["backward"] = topo.comm_stats.snapshot()
    del out
    return {
        "fwd_ms": times["forward"] * 1e3,
        "bwd_ms": times["backward"] * 1e3,
        "fwd_bwd_ms": times["forward_backward"] * 1e3,
        "traffic": traffic,
        "peak_mem_bytes": peak_memory(lambda: backward(forward()), opts.device),
    }


def peak_memory(step: Callable[[], object], device: torch.device) -> int | None:
    """torch.cuda.max_memory_allocated over one step (inputs already allocated count)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = step()
    torch.cuda.synchronize(device)
    del grads
    return torch.cuda.max_memory_allocated(device)


def emulate(cfg: Config, opts: Options, monolithic: dict[str, dict]) -> dict:
    """One configuration: emulate the chosen rank under a fake world of ``cfg.world``."""
    rank_map = RankMap(
        world_size=cfg.world,
        ranks_per_node=cfg.ranks_per_node,
        ulysses_degree=cfg.ulysses,
        ring_degree=cfg.ring,
        dp_degree=cfg.world // cfg.sp,
    )
    rank, why = emulated_rank(rank_map, cfg, opts.rank)
    with fake_world(cfg.world, rank, opts.device):
        topo = usp.build_topology(
            cfg.ulysses, cfg.ring, ranks_per_node=cfg.ranks_per_node, device_type=opts.device.type
        )
        try:
            measured = measure_rank(cfg, topo, opts)
        finally:
            topo.destroy()
    if opts.device.type == "cuda":
        torch.cuda.empty_cache()
    return build_row(cfg, opts, rank_map, rank, why, measured, monolithic)


def build_row(cfg, opts, rank_map, rank, why, measured, monolithic) -> dict:
    info = rank_map.info(rank)
    dtype = DTYPES[cfg.dtype]
    acc = 8 if dtype == torch.float64 else 4
    formula = traffic_formula(
        cfg.shape,
        batch=cfg.batch,
        seqlen=cfg.seqlen,
        ulysses=cfg.ulysses,
        ring=cfg.ring,
        ring_impl=cfg.ring_impl,
        item_bytes=dtype.itemsize,
        acc_bytes=acc,
    )
    links = links_of(rank_map, rank, opts)
    times = comm_ms(measured["traffic"], links)
    fwd_bwd_ms = measured["fwd_bwd_ms"]
    compute = {"forward": measured["fwd_ms"], "backward": measured["bwd_ms"]}
    modelled = sum(modelled_pass_ms(compute[p], times.get(p, {})) for p in compute)
    flops = attention_flops(cfg.batch, cfg.seqlen, cfg.shape.heads, cfg.shape.head_dim, cfg.causal)
    row = {
        **asdict(cfg),
        **asdict(cfg.shape),
        "sp": cfg.sp,
        "dp": cfg.world // cfg.sp,
        "rank": rank,
        "rank_note": why,
        "ring_rank": info.ring,
        "ulysses_rank": info.ulysses,
        "node": info.node,
        "work_share": work_share(cfg, info.ring),
        **measured,
        "tflops_per_rank": flops / cfg.sp / (fwd_bwd_ms / 1e3) / 1e12,
        "accounted_bytes": accounted_bytes(cfg),
        "formula": formula,
        "bytes_vs_formula": bytes_ratio(measured["traffic"], formula),
        "traffic_matches_formula": measured["traffic"] == formula,
        "links": {kind: asdict(link) for kind, link in links.items()},
        "comm_ms": times,
        "compute_ms": compute,
        "modelled_fwd_bwd_ms": modelled,
    }
    for key, ref in (("", monolithic["same"]), ("_fa2", monolithic["fa2"])):
        ideal = None if ref["ms"] is None else ref["ms"] / cfg.sp
        row[f"monolithic{key}_ms"], row[f"monolithic{key}_note"] = ref["ms"], ref["note"]
        row[f"ideal{key}_ms"] = ideal
        row[f"efficiency{key}"] = None if ideal is None else ideal / fwd_bwd_ms
    ideal = row["ideal_ms"]
    row["modelled_efficiency"] = None if ideal is None else ideal / modelled
    return row


# ------------------------------------------------------------------ the sweep
@dataclass(frozen=True)
class Scenario:
    preset: str
    seqlen: int
    world: int
    grids: tuple[tuple[int, int], ...]


def default_scenarios(device: torch.device) -> list[Scenario]:
    if device.type == "cuda":
        return [
            Scenario("llama3-8b", 131072, 8, ((1, 8), (2, 4), (4, 2), (8, 1))),
            Scenario("llama3-8b", 1048576, 64, ((8, 8),)),
        ]
    return [Scenario("tiny", 512, 8, ((1, 8), (2, 4), (4, 2), (8, 1)))]


def configs_of(scenario: Scenario, args) -> list[Config]:
    """Every (grid, layout, ring impl, backend); a ring of one has neither layout nor impl
    to choose, so it runs once."""
    configs = []
    for u, r in scenario.grids:
        for layout in args.layouts if r > 1 else args.layouts[:1]:
            impls = args.ring_impls if r > 1 else args.ring_impls[:1]
            for impl in impls:
                for backend in args.backends:
                    configs.append(
                        Config(
                            scenario.preset,
                            scenario.seqlen,
                            scenario.world,
                            u,
                            r,
                            layout,
                            impl,
                            backend,
                            not args.non_causal,
                            args.batch,
                            args.dtype,
                            args.ranks_per_node,
                        )
                    )
    return configs


def parse_grid(text: str) -> tuple[int, int]:
    try:
        u, r = (int(x) for x in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"grid {text!r} is not ULYSSESxRING, e.g. 4x2") from None
    return u, r


def scenarios_from(args, device: torch.device) -> list[Scenario]:
    if all(getattr(args, n) is None for n in ("preset", "seqlen", "world", "grids")):
        return default_scenarios(device)
    default = default_scenarios(device)[0]
    preset = args.preset or default.preset
    world = args.world or default.world
    grids = args.grids
    if grids is None:  # every grid of the whole world the heads and nodes allow
        shape = PRESETS[preset]
        grids = valid_degree_pairs(shape.heads, shape.kv_heads, world, args.ranks_per_node)
    return [Scenario(preset, args.seqlen or default.seqlen, world, tuple(grids))]


def parse_args(argv, device: torch.device):
    cuda = device.type == "cuda"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--seqlen", type=int, default=None, help="tokens of one SP replica's sequence")
    p.add_argument("--world", type=int, default=None, help="world size (dp = world / (u * r))")
    p.add_argument(
        "--grids", type=parse_grid, nargs="+", default=None, help="(ulysses, ring) as UxR"
    )
    p.add_argument(
        "--layouts", nargs="+", default=["zigzag", "contiguous"], choices=["zigzag", "contiguous"]
    )
    p.add_argument(
        "--ring-impls", nargs="+", default=["p2p", "allgather"], choices=["p2p", "allgather"]
    )
    p.add_argument("--backends", nargs="+", default=["cudnn" if cuda else "cpu"])
    p.add_argument(
        "--fa2-backend", default="flash", help="the FA2 reference for the second efficiency"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument(
        "--rank", type=int, default=None, help="global rank to emulate (default: the slowest)"
    )
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument(
        "--intra-node-gbps", type=float, default=900.0, help="per GPU, inside a node (NVLink)"
    )
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="per GPU, across nodes")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5 if cuda else 3)
    p.add_argument("--max-monolithic-tokens", type=int, default=131072)
    p.add_argument(
        "--out", type=Path, default=None, help="directory for emulate.json and emulate.md"
    )
    return p.parse_args(argv)


def run_sweep(args, opts: Options) -> list[dict]:
    rows, references = [], {}
    for scenario in scenarios_from(args, opts.device):
        for cfg in configs_of(scenario, args):
            same = _reference(references, cfg, cfg.backend, opts)
            fa2 = _reference(references, cfg, args.fa2_backend, opts)
            row = emulate(cfg, opts, {"same": same, "fa2": fa2})
            print(progress_line(cfg, row), flush=True)
            rows.append(row)
    return rows


def _reference(cache: dict, cfg: Config, backend: str, opts: Options) -> dict:
    key = (cfg.preset, cfg.seqlen, cfg.causal, cfg.batch, cfg.dtype, backend)
    if key not in cache:
        cache[key] = monolithic_reference(replace(cfg, backend=backend), backend, opts)
    return cache[key]


# ------------------------------------------------------------------ reporting
def _fmt(value, spec: str = ".3g", missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def _mb(n: int) -> str:
    return f"{n / 1e6:.4g}"


def progress_line(cfg: Config, row: dict) -> str:
    return (
        f"{cfg.label()}: rank {row['rank']} ({row['rank_note']}) fwd+bwd {row['fwd_bwd_ms']:.3g} ms, "
        f"efficiency {_fmt(row['efficiency'], '.1%')} (vs FA2 {_fmt(row['efficiency_fa2'], '.1%')}), "
        f"bytes/formula {row['bytes_vs_formula']:.2f}"
    )


def setup_text(args, opts: Options, rows: list[dict]) -> str:
    device = torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else "CPU"
    notes = sorted({r["monolithic_note"] for r in rows} | {r["monolithic_fa2_note"] for r in rows})
    lines = [
        f"torch {torch.__version__}, {device}, {args.dtype}, {'non-causal' if args.non_causal else 'causal'}, "
        f"batch {args.batch}, {args.ranks_per_node} ranks per node, fake process group; "
        f"median of {opts.repeats} after {opts.warmup} warm-up",
        f"links: {opts.intra_gbps:g} GB/s intra-node, {opts.inter_gbps:g} GB/s inter-node per GPU "
        "(ulysses-in-node placement: the all-to-all stays in a node; ring traffic is inter-node "
        "when the ring group spans nodes)",
        "monolithic references: " + "; ".join(notes),
    ]
    return "\n".join(lines)


def compute_table(rows: list[dict]) -> str:
    lines = [
        "| model | tokens | world | u x r | layout | ring | backend | rank | work share | fwd ms | fwd+bwd ms "
        "| TFLOP/s/rank | eff. (same backend) | eff. vs FA2 | modelled ms (with comm) | modelled eff. "
        "| peak GiB | accounted GiB | bytes / formula |",
        "|" + "---|" * 19,
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['seqlen']} | {r['world']} | {r['ulysses']} x {r['ring']} | {r['layout']} "
            f"| {r['ring_impl'] if r['ring'] > 1 else '-'} | {r['backend']} | {r['rank']} | {r['work_share']:.2f} "
            f"| {r['fwd_ms']:.3g} | {r['fwd_bwd_ms']:.3g} | {r['tflops_per_rank']:.3g} "
            f"| {_fmt(r['efficiency'], '.1%')} | {_fmt(r['efficiency_fa2'], '.1%')} "
            f"| {r['modelled_fwd_bwd_ms']:.3g} | {_fmt(r['modelled_efficiency'], '.1%')} "
            f"| {_fmt(None if r['peak_mem_bytes'] is None else r['peak_mem_bytes'] / GIB)} "
            f"| {r['accounted_bytes']['total'] / GIB:.3g} | {r['bytes_vs_formula']:.2f} |"
        )
    return "\n".join(lines)


def traffic_table(rows: list[dict]) -> str:
    lines = [
        "| model | tokens | u x r | layout | ring | pass | kind | calls | sent MB | received MB "
        "| link | comm ms | compute ms (same pass) | bytes / formula |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        for phase, kinds in r["traffic"].items():
            for kind, c in kinds.items():
                link = r["links"][kind]
                expected = r["formula"][phase].get(kind)
                ratio = (
                    (c["sent"] + c["received"]) / (expected["sent"] + expected["received"])
                    if expected
                    else math.inf
                )
                lines.append(
                    f"| {r['preset']} | {r['seqlen']} | {r['ulysses']} x {r['ring']} | {r['layout']} "
                    f"| {r['ring_impl'] if r['ring'] > 1 else '-'} | {phase} | {kind} | {c['calls']} "
                    f"| {_mb(c['sent'])} | {_mb(c['received'])} | {link['name']} {link['gbps']:g} GB/s "
                    f"| {r['comm_ms'][phase][kind]:.3g} | {r['compute_ms'][phase]:.3g} | {ratio:.2f} |"
                )
    return "\n".join(lines)


def write_outputs(out: Path, setup: str, rows: list[dict], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "emulate.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    (out / "emulate.md").write_text(markdown + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args = parse_args(argv, device)
    opts = Options(
        device=device,
        warmup=args.warmup,
        repeats=args.repeats,
        rank=args.rank,
        intra_gbps=args.intra_node_gbps,
        inter_gbps=args.inter_node_gbps,
        max_monolithic_tokens=args.max_monolithic_tokens,
    )
    rows = run_sweep(args, opts)
    setup = setup_text(args, opts, rows)
    markdown = "\n\n".join(
        [
            setup,
            "### Compute and memory per rank",
            compute_table(rows),
            "### Traffic per rank",
            traffic_table(rows),
        ]
    )
    print(markdown)
    if args.out is not None:
        write_outputs(args.out, setup, rows, markdown)
    return rows


if __name__ == "__main__":
    main()

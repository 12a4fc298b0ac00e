"""What ``usp plan`` prints: a ranked table, the best plan's breakdown and the lines to
paste into the config; or one JSON document."""

from __future__ import annotations

from dataclasses import dataclass

from usp.config import toml_repr
from usp.planner.search import GIB, Candidate, Cluster

#: rows of the human table (the JSON lists every candidate)
TABLE_ROWS = 12
_PARTS = (
    ("parameters", ("parameters", "parameters_gathered", "buffers")),
    ("gradients", ("gradients", "gradients_unsharded")),
    ("optimizer state", ("optimizer_state",)),
    ("activations", ("activations", "inputs")),
    ("temporaries", ("temporaries",)),
    ("comm buffers", ("comm_all_gather", "comm_reduce_scatter")),
)


@dataclass(frozen=True)
class PlanResult:
    config: str
    model_name: str
    seq_len: int
    cluster: Cluster
    device: str
    gpu: str
    candidates: list[Candidate]  # ranked
    max_seq_len: int
    max_seq_layout: object | None
    notes: list[str]
    seconds: float

    @property
    def best(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits]
        return fitting[0] if fitting else None


def candidate_json(c: Candidate) -> dict:
    layout = c.layout
    return {
        "ulysses": layout.ulysses,
        "ring": layout.ring,
        "dp": layout.dp,
        "activation_checkpointing": layout.levers.activation_checkpointing,
        "mlp_tile_tokens": layout.levers.mlp_tile_tokens,
        "attention_head_chunks": layout.levers.attention_head_chunks,
        "tokens_per_rank": c.seq_len // layout.sp,
        "peak_device_gib": round(c.peak_device_gib, 3),
        "peak_host_gib": round(c.peak_host_gib, 3),
        "breakdown_gib": {k: round(v / GIB, 3) for k, v in c.footprint.breakdown.items()},
        "fits": c.fits,
        "why_not": c.why_not,
        "step_time_s_estimate": round(c.step_time_s, 4),
        "comm_bytes_per_step": c.comm_bytes,
    }


def to_json(result: PlanResult) -> dict:
    best = result.best
    cl = result.cluster
    return {
        "config": result.config,
        "model": result.model_name,
        "device": result.device,
        "gpu": result.gpu,
        "seq_len": result.seq_len,
        "world_size": cl.world_size,
        "nodes": cl.nodes,
        "gpus_per_node": cl.gpus_per_node,
        "gpu_memory_gib": cl.gpu_memory_gib,
        "host_memory_gib_per_node": cl.host_memory_gib,
        "intra_node_gbps": cl.intra_node_gbps,
        "inter_node_gbps": cl.inter_node_gbps,
        "candidates": [candidate_json(c) for c in result.candidates],
        "best": None if best is None else candidate_json(best),
        "max_seq_len": result.max_seq_len,
        "notes": result.notes,
        "seconds": round(result.seconds, 1),
    }


def _checkpointing(value) -> str:
    return toml_repr(value)


def table(result: PlanResult) -> str:
    header = (
        f"{'#':>2} {'ulysses':>7} {'ring':>4} {'dp':>3} {'ckpt':>9} {'tile':>5} {'heads':>5} "
        f"{'tokens/rank':>11} {'device GiB':>10} {'host GiB':>8} {'fits':>4} "
        f"{'step s (est.)':>13} {'comm GB':>8}"
    )
    lines = [header]
    for i, c in enumerate(result.candidates[:TABLE_ROWS], 1):
        layout, levers = c.layout, c.layout.levers
        comm = sum(c.comm_bytes.values()) / 1e9
        lines.append(
            f"{i:>2} {layout.ulysses:>7} {layout.ring:>4} {layout.dp:>3} "
            f"{_checkpointing(levers.activation_checkpointing):>9} {levers.mlp_tile_tokens:>5} "
            f"{levers.attention_head_chunks:>5} "
            f"{c.seq_len // layout.sp:>11,} {c.peak_device_gib:>10.1f} {c.peak_host_gib:>8.1f} "
            f"{'yes' if c.fits else 'no':>4} {c.step_time_s:>13.2f} {comm:>8.1f}"
        )
    hidden = len(result.candidates) - TABLE_ROWS
    if hidden > 0:
        lines.append(f"   ... {hidden} more (--json lists every one)")
    return "\n".join(lines)


def paste_lines(c: Candidate) -> str:
    layout = c.layout
    lines = [
        "[parallel]",
        f"ulysses = {layout.ulysses}",
        f"ring = {layout.ring}",
        f"dp = {layout.dp}",
        "",
        "[train]",
        f"seq_len = {c.seq_len}",
        *lever_lines(layout.levers),
    ]
    return "\n".join(lines)


def lever_lines(levers) -> list[str]:
    """The ``[train]`` lines that set ``levers`` (defaults left out but checkpointing)."""
    lines = [f"activation_checkpointing = {_checkpointing(levers.activation_checkpointing)}"]
    if levers.mlp_tile_tokens:
        lines.append(f"mlp_tile_tokens = {levers.mlp_tile_tokens}")
    if levers.attention_head_chunks > 1:
        lines.append(f"attention_head_chunks = {levers.attention_head_chunks}")
    return lines


def breakdown(c: Candidate) -> str:
    parts = c.footprint.breakdown
    shown = []
    for name, keys in _PARTS:
        value = sum(parts.get(k, 0) for k in keys) / GIB
        shown.append(f"{name} {value:.1f}")
    return ", ".join(shown) + " (GiB, at the peak)"


def text(result: PlanResult) -> str:
    cl = result.cluster
    memory_note = (
        f"{cl.gpu_memory_gib:g} GiB per GPU ({result.gpu})"
        if result.device == "cuda"
        else f"{cl.gpu_memory_gib:g} GiB per CPU rank"
    )
    lines = [
        f"usp plan: {result.config}",
        f"  model {result.model_name}; {result.seq_len:,} tokens per sequence; "
        f"{cl.nodes} node(s) x {cl.gpus_per_node} {result.device} ranks = {cl.world_size}; "
        f"{memory_note}, {cl.host_memory_gib:g} GiB host memory per node; links "
        f"{cl.intra_node_gbps:g} GB/s in a node, {cl.inter_node_gbps:g} GB/s across",
        "  memory: one rank's real training step measured under fake tensors (usp's own "
        "measurement); step time: an estimate from FLOPs and bytes",
        "",
        table(result),
        "",
    ]
    best = result.best
    if best is not None:
        lines += [
            f"best: {breakdown(best)}",
            "paste into the config:",
            "",
            paste_lines(best),
            "",
        ]
    if result.max_seq_len:
        m = result.max_seq_layout
        lines.append(
            f"longest sequence that fits: {result.max_seq_len:,} tokens "
            f"(ulysses {m.ulysses} x ring {m.ring}, {', '.join(lever_lines(m.levers))})"
        )
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"({result.seconds:.1f} s)")
    return "\n".join(lines)

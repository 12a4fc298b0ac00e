"""What ``usp plan`` prints: a ranked table, the best plan's breakdown and the lines to
paste into the config; or one JSON document."""

from __future__ import annotations

from dataclasses import dataclass

from usp.config import toml_repr
from usp.planner.footprint import scaling_runs
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
    max_seq_choice: object | None
    notes: list[str]
    seconds: float
    at_longest: Candidate | None = None  # max_seq_layout measured at max_seq_len
    #: ``--lengths``: the best layout's step on a length mix, per token placement
    #: (:func:`usp.planner.plan.length_mix`); None without one
    length_mix: dict | None = None
    parameters: int = 0  # the model's (every expert's, for a mixture of experts)
    active_parameters: int = 0  # those one token uses (its routed experts')

    @property
    def best(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits]
        return fitting[0] if fitting else None


def choice_json(choice) -> dict:
    """A layout's grid and levers, as the config keys that set them."""
    levers = choice.levers
    return {
        "ulysses": choice.ulysses,
        "ring": choice.ring,
        "dp": choice.dp,
        "activation_checkpointing": levers.activation_checkpointing,
        "mlp_tile_tokens": levers.mlp_tile_tokens,
        "attention_head_chunks": levers.attention_head_chunks,
        "offload_optimizer": levers.offload_optimizer,
        "offload_parameters": levers.offload_parameters,
    }


def item_json(item) -> dict:
    return {
        "name": item.name,
        "gib": round(item.nbytes / GIB, 3),
        "where": item.where,
        "added": item.added,
        "source": item.source,
    }


def candidate_json(c: Candidate) -> dict:
    choice = c.choice
    return {
        **choice_json(choice),
        "tokens_per_rank": c.seq_len // choice.sp,
        "peak_device_gib": round(c.peak_device_gib, 3),
        "device_total_gib": round(c.device_total_gib, 3),
        "peak_host_gib": round(c.peak_host_gib, 3),
        "overheads": [item_json(i) for i in c.items()],
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
        "parameters": result.parameters,
        "active_parameters": result.active_parameters,
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
        "max_seq_len_layout": (
            None if result.max_seq_choice is None else choice_json(result.max_seq_choice)
        ),
        "max_seq_len_candidate": (
            None if result.at_longest is None else candidate_json(result.at_longest)
        ),
        "length_mix": result.length_mix,
        "notes": result.notes,
        "seconds": round(result.seconds, 1),
    }


def _checkpointing(value) -> str:
    return toml_repr(value)


#: what each column of the table means (printed under it), one line each
COLUMNS = (
    ("#", "rank: layouts that fit first, fastest first, then the rest by device memory; "
     "* marks the best (the plan to paste)"),
    ("ulysses, ring, dp", "the degrees: Ulysses all-to-all group, ring group, data-parallel "
     "replicas ([parallel])"),
    ("ckpt", "[train] activation_checkpointing (true: recompute each layer in backward; "
     '"offload": its saved inputs in host memory too)'),
    ("tile", "[train] mlp_tile_tokens (the MLP runs over tiles of that many tokens; 0: off)"),
    ("heads", "[train] attention_head_chunks (the ring attends to that many groups of its KV "
     "heads in turn; 1: all at once)"),
    ("tokens/rank", "tokens of each sequence one rank holds: seq_len / (ulysses * ring)"),
    ("offload", "[train] offload_optimizer / offload_parameters: what of the training "
     'state lives in host memory ("optim": AdamW\'s state and step; "params": also the '
     "parameter and gradient shards; -: none)"),
    ("step GiB", "peak device memory of one rank's real training step, measured under "
     "fake tensors (parameters, gradients, optimizer state, activations, buffers, the "
     "attention kernels' workspaces)"),
    ("device GiB", "step GiB plus what the GPU spends besides: NCCL communicators, CUDA "
     "context, allocator reserve, margin (the lines below the table)"),
    ("host GiB", "peak host memory of one rank's tensors (offloaded activations, "
     "parameters, optimizer state; pinned rounding included); a node holds gpus_per_node "
     "of these, each rank's process and the node's reserve"),
    ("fits", "device GiB <= the GPU's memory, and the node's ranks with their host "
     "overheads within its host memory"),
    ("step s (est.)", "seconds per optimizer step, estimated from FLOPs and bytes at assumed "
     "kernel and link speeds (not measured)"),
    ("comm GB", "bytes one rank sends per optimizer step, in 1e9 B: Ulysses all-to-alls, the "
     "ring's K/V exchange and FSDP's all-gathers/reduce-scatters (counted, not measured)"),
)  # fmt: skip


def describe_choice(choice) -> str:
    """``ulysses 2 x ring 2 x dp 1, ckpt true, tile 0, heads 1``: one layout in a line."""
    levers = choice.levers
    offload = "" if levers.offload == "none" else f", offload {levers.offload}"
    return (
        f"ulysses {choice.ulysses} x ring {choice.ring} x dp {choice.dp}, ckpt "
        f"{_checkpointing(levers.activation_checkpointing)}, tile {levers.mlp_tile_tokens}, "
        f"heads {levers.attention_head_chunks}{offload}"
    )


def progress_intro(target, choices: list, jobs: int) -> str:
    """The first progress line: what ``usp plan`` is about to measure."""
    depths = len(scaling_runs(target.model))
    where = "in this process" if jobs == 1 else f"in {jobs} worker processes"
    return (
        f"usp plan: measuring one rank's training step under fake tensors for "
        f"{len(choices)} layouts at {target.seq_len:,} tokens ({depths} model depth(s) each, "
        f"{where}), then the longest sequence that fits (a few more)"
    )


def measurement_line(choice, seq_len: int, seconds: float, done: int, asked: int) -> str:
    """One finished measurement; ``asked`` grows while the longest-sequence search runs."""
    return (
        f"  [{done}/{asked}] {describe_choice(choice)} at {seq_len:,} tokens: {seconds:.1f} s CPU"
    )


def legend() -> str:
    width = max(len(name) for name, _ in COLUMNS)
    return "\n".join(f"  {name:<{width}}  {text}" for name, text in COLUMNS)


#: the table's offload column
OFFLOAD_SHORT = {"none": "-", "optimizer": "optim", "parameters": "params"}


def table(result: PlanResult) -> str:
    header = (
        f"{'#':>3} {'ulysses':>7} {'ring':>4} {'dp':>3} {'ckpt':>9} {'tile':>5} {'heads':>5} "
        f"{'offload':>7} {'tokens/rank':>11} {'step GiB':>8} {'device GiB':>10} "
        f"{'host GiB':>8} {'fits':>4} {'step s (est.)':>13} {'comm GB':>8}"
    )
    lines = [header]
    best = result.best
    for i, c in enumerate(result.candidates[:TABLE_ROWS], 1):
        choice, levers = c.choice, c.choice.levers
        comm = sum(c.comm_bytes.values()) / 1e9
        mark = "*" if c is best else " "
        lines.append(
            f"{mark}{i:>2} {choice.ulysses:>7} {choice.ring:>4} {choice.dp:>3} "
            f"{_checkpointing(levers.activation_checkpointing):>9} {levers.mlp_tile_tokens:>5} "
            f"{levers.attention_head_chunks:>5} {OFFLOAD_SHORT[levers.offload]:>7} "
            f"{c.seq_len // choice.sp:>11,} {c.peak_device_gib:>8.1f} "
            f"{c.device_total_gib:>10.1f} {c.peak_host_gib:>8.1f} "
            f"{'yes' if c.fits else 'no':>4} {c.step_time_s:>13.2f} {comm:>8.1f}"
        )
    hidden = len(result.candidates) - TABLE_ROWS
    if hidden > 0:
        lines.append(f"   ... {hidden} more (--json lists every one)")
    return "\n".join(lines)


def paste_lines(c: Candidate) -> str:
    choice = c.choice
    lines = [
        "[parallel]",
        f"ulysses = {choice.ulysses}",
        f"ring = {choice.ring}",
        f"dp = {choice.dp}",
        "",
        "[train]",
        f"seq_len = {c.seq_len}",
        *lever_lines(choice.levers),
    ]
    return "\n".join(lines)


def lever_lines(levers) -> list[str]:
    """The ``[train]`` lines that set ``levers`` (defaults left out but checkpointing)."""
    lines = [f"activation_checkpointing = {_checkpointing(levers.activation_checkpointing)}"]
    if levers.mlp_tile_tokens:
        lines.append(f"mlp_tile_tokens = {levers.mlp_tile_tokens}")
    if levers.attention_head_chunks > 1:
        lines.append(f"attention_head_chunks = {levers.attention_head_chunks}")
    if levers.offload_optimizer:
        lines.append("offload_optimizer = true")
    if levers.offload_parameters:
        lines.append("offload_parameters = true")
    return lines


def overhead_lines(c: Candidate, cluster: Cluster) -> list[str]:
    """The named lines of what a candidate's GPU and host spend (one per item of
    :mod:`usp.planner.overheads`, with its source), and the totals against the GPU's and
    the node's memory."""
    where = {"device": "device", "host": "host/rank", "node": "host/node"}
    rows = [("measured step (device peak)", c.footprint.peak_device, "device", "")]
    rows += [
        (("+ " if i.added else "  ") + i.name, i.nbytes, where[i.where], i.source)
        for i in c.items()
    ]
    width = max(len(name) for name, *_ in rows)
    lines = [
        f"  {name:<{width}} {nbytes / GIB:>8.2f} GiB  {place:<9}  {source}".rstrip()
        for name, nbytes, place, source in rows
    ]
    lines.append(
        f"  = device {c.device_total_gib:.1f} of {cluster.gpu_memory_gib:g} GiB; host "
        f"{_host_total(c) / GIB:.1f} of {cluster.host_memory_gib:g} GiB per node"
    )
    return lines


def _host_total(c: Candidate) -> float:
    if c.overheads is None:
        return c.footprint.host_total
    return c.overheads.budget(c.footprint.extras).host_total(c.footprint.host_total)


def breakdown(c: Candidate) -> str:
    parts = c.footprint.breakdown
    shown = []
    for name, keys in _PARTS:
        value = sum(parts.get(k, 0) for k in keys) / GIB
        shown.append(f"{name} {value:.1f}")
    return ", ".join(shown) + " (GiB, at the peak)"


def _parameters(result: PlanResult) -> str:
    total, active = result.parameters, result.active_parameters
    if active == total:
        return f"{total / 1e9:.2f}B parameters"
    return f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token"


def mix_lines(mix: dict) -> list[str]:
    """The ``--lengths`` section: both token placements on the best layout."""
    u, r = mix["grid"]
    lines = [
        f"length mix: {mix['document_count']:,} documents in {mix['rows']:,} rows, on the best "
        f"layout's grid u{u} x r{r} ([parallel] token_placement = {mix['configured']!r}):"
    ]
    seq = mix["sequence"]
    for placement in ("sequence", "documents"):
        m = mix[placement]
        change = ""
        if placement == "documents" and seq["step_s"] > 0:
            change = f" ({m['step_s'] / seq['step_s'] - 1:+.1%} against sequence)"
        lines.append(
            f"  {placement:<9}  {m['bytes_per_rank_per_row'] / 1e9:.2f} GB sent a rank per "
            f"row; busiest rank: {m['work_max_over_mean']:.3f} x the mean work, at most "
            f"{m['tokens_max']:,} tokens; ~{m['step_s']:.2f} s a step{change}"
        )
    lines.append(
        '  (memory was measured with seq_len / sp tokens a rank; "documents" gives a '
        "rank up to the tokens shown)"
    )
    return lines


def text(result: PlanResult) -> str:
    cl = result.cluster
    memory_note = (
        f"{cl.gpu_memory_gib:g} GiB per GPU ({result.gpu})"
        if result.device == "cuda"
        else f"{cl.gpu_memory_gib:g} GiB per CPU rank"
    )
    lines = [
        f"usp plan: {result.config}",
        f"  model {result.model_name} ({_parameters(result)}); {result.seq_len:,} tokens per "
        "sequence; "
        f"{cl.nodes} node(s) x {cl.gpus_per_node} {result.device} ranks = {cl.world_size}; "
        f"{memory_note}, {cl.host_memory_gib:g} GiB host memory per node; links "
        f"{cl.intra_node_gbps:g} GB/s in a node, {cl.inter_node_gbps:g} GB/s across",
        "  memory: one rank's real training step measured under fake tensors (usp's own "
        "measurement); step time: an estimate from FLOPs and bytes",
        "",
        table(result),
        "",
        "columns:",
        legend(),
        "",
    ]
    best = result.best
    if best is not None:
        lines += [
            f"best (* above): {breakdown(best)}",
            "what its GPU and host hold:",
            *overhead_lines(best, cl),
            "paste into the config:",
            "",
            paste_lines(best),
            "",
        ]
    if result.length_mix is not None:
        lines += [*mix_lines(result.length_mix), ""]
    if result.max_seq_len:
        m = result.max_seq_choice
        lines.append(
            f"longest sequence that fits: {result.max_seq_len:,} tokens "
            f"(ulysses {m.ulysses} x ring {m.ring}, {', '.join(lever_lines(m.levers))})"
        )
        if result.at_longest is not None:
            lines += ["what its GPU and host hold there:", *overhead_lines(result.at_longest, cl)]
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"({result.seconds:.1f} s)")
    return "\n".join(lines)

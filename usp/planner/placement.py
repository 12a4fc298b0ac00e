"""A packed row's documents placed on the SP ranks, in numbers: what each rank holds,
its work and the bytes it sends, for ``placement="sequence"`` (every document split
over the group) and ``"documents"`` (:mod:`usp.sp.assignment`). The closed forms that
``benchmarks/placement.py`` prints and ``usp plan --lengths`` adds up; the traffic is
:func:`usp.planner.traffic.traffic_formula` of the split documents alone (a whole
document sends nothing), which ``tests/attention/test_placement_traffic.py`` checks
against the byte counters of real steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from usp.models import model_counts
from usp.planner.hardware import (
    ATTENTION_TFLOPS,
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    GEMM_TFLOPS,
)
from usp.planner.mixer_traffic import mamba2_traffic
from usp.planner.traffic import gdn_traffic, traffic_formula
from usp.sp.assignment import DocumentCost, assign_documents
from usp.sp.sharding import required_multiple

PLACEMENTS = ("sequence", "documents")


@dataclass(frozen=True)
class PlacedRow:
    """One packed row on ring x ulysses ranks: the lengths of the documents split over
    the group, and per SP rank its tokens and its work (FLOPs, forward + backward)
    split into the token-linear part and the attention pairs' part."""

    placement: str
    split_lengths: tuple[int, ...]
    tokens: tuple[int, ...]
    linear_work: tuple[float, ...]
    attention_work: tuple[float, ...]

    @property
    def work(self) -> tuple[float, ...]:
        return tuple(a + b for a, b in zip(self.linear_work, self.attention_work))


def place_row(
    lengths, placement: str, *, ring: int, ulysses: int, layout: str, cost: DocumentCost
) -> PlacedRow:
    """``lengths`` (one row's documents, each a multiple of the layout's chunks; for
    ``"documents"`` the split ones a multiple of the sequence multiple) placed."""
    sp = ring * ulysses
    linear = DocumentCost(cost.token_flops, (), cost.linear_ring_flops)
    pairs = DocumentCost(0.0, cost.attention, 0.0)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    if placement == "sequence":
        split, whole = tuple(n for n in lengths if n), [()] * sp
    else:
        assignment = assign_documents(
            bounds, ring=ring, ulysses=ulysses, layout=layout,
            multiple=required_multiple(ring, ulysses, layout), cost=cost,
        )  # fmt: skip
        split = tuple(assignment.lengths[d] for d in assignment.split)
        whole = [tuple(assignment.lengths[d] for d in docs) for docs in assignment.whole]
    linear_work = [sum(linear.whole(n) for n in docs) for docs in whole]
    attention_work = [sum(pairs.whole(n) for n in docs) for docs in whole]
    for n in split:  # every rank's share of each split document, computed once
        for rank, (a, b) in enumerate(zip(linear.split_shares(n, ring, ulysses, layout),
                                          pairs.split_shares(n, ring, ulysses, layout))):  # fmt: skip
            linear_work[rank] += a
            attention_work[rank] += b
    tokens = [sum(split) // sp + sum(docs) for docs in whole]
    return PlacedRow(placement, split, tuple(tokens), tuple(linear_work), tuple(attention_work))


def row_bytes(
    row: PlacedRow, model, *, ring: int, ulysses: int, layout: str, ring_impl: str,
    item_bytes: int, acc_bytes: int = 4, gate_bytes: int = 4, state_bytes: int = 4,
) -> list[dict[str, int]]:  # fmt: skip
    """Bytes each SP rank sends for the row in one forward and backward of every layer,
    by collective kind (``all_to_all``, ``p2p``, ``all_gather``, ``reduce_scatter``):
    the attention layers' :func:`traffic_formula` (the ring rank's own where a window
    makes them differ), the Gated DeltaNet layers' :func:`gdn_traffic` and the Mamba-2
    layers' :func:`usp.planner.mixer_traffic.mamba2_traffic`, over the
    split documents only. ``model``: a usp model config."""
    sp = ring * ulysses
    if not row.split_lengths:
        return [{} for _ in range(sp)]
    seqlen = sum(row.split_lengths)
    # one split document is placed as a dense sequence (usp.ring.placement)
    documents = row.split_lengths if len(row.split_lengths) > 1 else None
    windows = _attention_windows(model)
    per_ring_rank = []
    for ring_rank in range(ring):
        sent: dict[str, int] = {}
        for window, layers in windows.items():
            traffic = traffic_formula(
                _Heads(model.num_attention_heads, model.num_key_value_heads,
                       model.attention_head_dim),
                batch=1, seqlen=seqlen, ulysses=ulysses, ring=ring, ring_impl=ring_impl,
                item_bytes=item_bytes, acc_bytes=acc_bytes, window=window, layout=layout,
                doc_lengths=documents, rank=ring_rank,
            )  # fmt: skip
            _add(sent, traffic, layers)
        linear_layers = list(getattr(model, "layer_types", None) or ()).count("linear_attention")
        if linear_layers:
            traffic = gdn_traffic(
                batch=1, seqlen=seqlen, ulysses=ulysses, ring=ring,
                key_heads=model.linear_num_key_heads, heads=model.linear_num_value_heads,
                key_dim=model.linear_key_head_dim, value_dim=model.linear_value_head_dim,
                kernel=model.linear_conv_kernel_dim, layout=layout,
                documents=len(row.split_lengths), item_bytes=item_bytes,
                gate_bytes=gate_bytes, state_bytes=state_bytes,
            )  # fmt: skip
            _add(sent, traffic, linear_layers)
        mamba_layers = list(getattr(model, "layer_types", None) or ()).count("mamba")
        if mamba_layers:  # (Mamba-2: Granite 4 hybrid)
            traffic = mamba2_traffic(
                batch=1, seqlen=seqlen, ulysses=ulysses, ring=ring, heads=model.mamba_n_heads,
                head_dim=model.mamba_d_head, groups=model.mamba_n_groups,
                state_size=model.mamba_d_state, kernel=model.mamba_d_conv, layout=layout,
                documents=len(row.split_lengths), item_bytes=item_bytes,
                state_bytes=state_bytes,
            )  # fmt: skip
            _add(sent, traffic, mamba_layers)
        per_ring_rank.append(sent)
    return [per_ring_rank[rank // ulysses] for rank in range(sp)]


def _add(sent: dict[str, int], traffic, layers: int) -> None:
    for kinds in traffic.values():  # forward, backward
        for kind, counts in kinds.items():
            sent[kind] = sent.get(kind, 0) + layers * counts["sent"]


@dataclass(frozen=True)
class Machine:
    """What the step-time estimate assumes (:mod:`usp.planner.hardware`'s figures by
    default): GPUs per node, link GB/s inside and across nodes, TFLOP/s of the matmuls
    and of attention."""

    gpus_per_node: int = 8
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    gemm_tflops: float = GEMM_TFLOPS
    attention_tflops: float = ATTENTION_TFLOPS["cudnn"]


def step_seconds(row: PlacedRow, sent: list[dict[str, int]], *, ulysses: int, ring: int,
                 machine: Machine = Machine()) -> list[float]:  # fmt: skip
    """Each SP rank's estimated seconds for the row (the step waits for the largest), as
    ``usp plan`` estimates a step: matmuls at ``gemm_tflops``; attention at
    ``attention_tflops``, overlapping the p2p ring (double buffering); the Ulysses
    all-to-alls and the ring's all-gathers / reduce-scatters serial. Ulysses groups sit
    inside a node; the ring crosses nodes when the SP group is larger than one."""
    ulysses_gbps = machine.intra_node_gbps
    crosses = ulysses * ring > machine.gpus_per_node
    ring_gbps = machine.inter_node_gbps if crosses else machine.intra_node_gbps
    seconds = []
    for rank, kinds in enumerate(sent):
        gemm = row.linear_work[rank] / (machine.gemm_tflops * 1e12)
        attention = row.attention_work[rank] / (machine.attention_tflops * 1e12)
        p2p = kinds.get("p2p", 0) / (ring_gbps * 1e9)
        serial = kinds.get("all_to_all", 0) / (ulysses_gbps * 1e9)
        serial += (kinds.get("all_gather", 0) + kinds.get("reduce_scatter", 0)) / (ring_gbps * 1e9)
        seconds.append(gemm + max(attention, p2p) + serial)
    return seconds


def _attention_windows(model) -> dict[int | None, int]:
    """Softmax-attention layers by sliding window (transformers' W; None: full)."""
    layers = model.num_hidden_layers
    kinds = list(getattr(model, "layer_types", None) or ())
    groups: dict[int | None, int] = {}
    for index in range(layers):
        if kinds and kinds[index] in ("linear_attention", "mamba"):  # (GDN, Mamba-2)
            continue
        window = model.layer_window(index) if hasattr(model, "layer_window") else None
        groups[window] = groups.get(window, 0) + 1
    return groups


@dataclass(frozen=True)
class _Heads:
    heads: int
    kv_heads: int
    head_dim: int


def pack_lengths(lengths, seq_len: int, multiple: int) -> list[list[int]]:
    """Documents packed in order into rows of ``seq_len`` tokens as ``usp train`` packs
    them: each padded at its end to a multiple of ``multiple``, a new row when the next
    one does not fit, the rest of a row one padding document. A document longer than
    ``seq_len`` is cut into pieces of ``seq_len`` (the last padded)."""
    rows, row, used = [], [], 0
    pieces = []
    for n in lengths:
        while n > seq_len:
            pieces.append(seq_len)
            n -= seq_len
        if n > 0:
            pieces.append(n)
    for n in pieces:
        padded = -(-n // multiple) * multiple
        if used + padded > seq_len:
            rows.append(row + ([seq_len - used] if used < seq_len else []))
            row, used = [], 0
        row.append(padded)
        used += padded
    if row:
        rows.append(row + ([seq_len - used] if used < seq_len else []))
    return rows


def mix_steps(lengths, *, model, ulysses: int, ring: int, seq_len: int, layout: str = "zigzag",
              ring_impl: str = "p2p", item_bytes: int = 2,
              machine: Machine = Machine()) -> list[dict]:  # fmt: skip
    """``lengths`` packed into rows of ``seq_len`` (:func:`pack_lengths`, documents padded
    to the grid's sequence multiple) and placed both ways: per row and placement, each
    rank's bytes (one forward and backward of every layer), linear and attention work,
    tokens, the split documents' count and the row's estimated seconds (its busiest
    rank's, :func:`step_seconds`). ``model``: a usp model config."""
    multiple = required_multiple(ring, ulysses, layout)
    cost = DocumentCost() if model is None else _cost_of(model)
    steps = []
    for row_lengths in pack_lengths(lengths, seq_len, multiple):
        step = {"documents_in_step": len(row_lengths)}
        for placement in PLACEMENTS:
            row = place_row(row_lengths, placement, ring=ring, ulysses=ulysses, layout=layout,
                            cost=cost)  # fmt: skip
            kinds = row_bytes(row, model, ring=ring, ulysses=ulysses, layout=layout,
                              ring_impl=ring_impl, item_bytes=item_bytes)  # fmt: skip
            seconds = step_seconds(row, kinds, ulysses=ulysses, ring=ring, machine=machine)
            step[placement] = {
                "bytes": [sum(by_kind.values()) for by_kind in kinds],
                "linear": row.linear_work, "attention": row.attention_work, "work": row.work,
                "tokens": row.tokens, "split": len(row.split_lengths), "step_s": max(seconds),
            }  # fmt: skip
        steps.append(step)
    return steps


def mix_totals(steps: list[dict]) -> dict:
    """Over all rows, per placement: ``bytes_max`` / ``bytes_mean`` (per rank, summed over
    the rows), ``work_max_over_mean`` (the busiest rank's work summed over the rows, over
    the mean's), ``step_s`` (the rows' estimated seconds, summed) and ``tokens_max`` (the
    most tokens a rank holds in one row)."""
    out = {}
    for placement in PLACEMENTS:
        ranks = len(steps[0][placement]["bytes"])
        per_rank = [sum(s[placement]["bytes"][r] for s in steps) for r in range(ranks)]
        busiest = sum(max(s[placement]["work"]) for s in steps)
        mean = sum(sum(s[placement]["work"]) / ranks for s in steps)
        out[placement] = {
            "bytes_max": max(per_rank),
            "bytes_mean": sum(per_rank) / ranks,
            "work_max_over_mean": busiest / mean,
            "step_s": sum(s[placement]["step_s"] for s in steps),
            "tokens_max": max(max(s[placement]["tokens"]) for s in steps),
        }
    return out


def _cost_of(model) -> DocumentCost:
    return model_counts(model).document_cost()

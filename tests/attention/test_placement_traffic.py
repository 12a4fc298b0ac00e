"""Every byte a placed batch moves, per rank and collective kind, equals the formula, for
both placements, on 4 gloo ranks: ``placement="sequence"`` moves every document
(:func:`traffic_formula` of the whole row), ``"documents"`` only the split ones (the
formula of the split documents as one row; whole documents move nothing). Attention
(both ring implementations, a sliding window) and a Gated DeltaNet layer, forward and
backward separately; and :func:`usp.planner.placement.row_bytes`, what
``benchmarks/placement.py`` reports, equals the counters' sum.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from gdn_cases import gdn_inputs
from usp_cases import topology

import usp
from usp.linear import gated_deltanet_usp
from usp.planner.placement import place_row, row_bytes
from usp.planner.traffic import gdn_traffic, traffic_formula
from usp.sp.assignment import DocumentCost

#: 104 tokens, each a multiple of 8 (every grid's sequence multiple): the 40 is split,
#: the others whole, one on each rank
LENGTHS = [16, 40, 16, 16, 16]
#: only short documents: "documents" splits none and moves nothing
SHORT = [8, 16, 8, 16, 8, 16, 8, 16]
HEADS, KV_HEADS, DIM = 4, 2, 8
COST = DocumentCost()


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for kind, counts in after.items():
        diff = {k: n - before.get(kind, {}).get(k, 0) for k, n in counts.items()}
        if any(diff.values()):
            out[kind] = diff
    return out


def measure(ulysses, ring, cases):
    topo = topology(ulysses, ring)
    results = []
    for placement, ring_impl, window, lengths in cases:
        plan = usp.Plan(topo, placement=placement, ring_impl=ring_impl, backend="math")
        cu = cu_of(lengths)
        packed = plan.pack(cu)
        gen = torch.Generator().manual_seed(3)
        q, k, v, dout = (
            torch.randn(1, sum(lengths), h, DIM, generator=gen)
            for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)
        )
        local = [plan.shard(t, packed=packed).requires_grad_() for t in (q, k, v)]
        topo.comm_stats.reset()
        out = plan.attention(*local, causal=True, packed=packed, window=window)
        forward = topo.comm_stats.snapshot()
        out.backward(plan.shard(dout, packed=packed))
        attention = {"forward": _delta(forward, {}),
                     "backward": _delta(topo.comm_stats.snapshot(), forward)}  # fmt: skip
        # one Gated DeltaNet layer (2 key heads, 4 value heads, conv kernel 4)
        inputs, ws, gdn_dout = gdn_inputs(1, sum(lengths), 2, 4, 8, 8, 4, dtype=torch.float32)
        gdn_local = [plan.shard(t, packed=packed).requires_grad_() for t in inputs]
        topo.comm_stats.reset()
        gdn_out = gated_deltanet_usp(*gdn_local, plan, conv_weights=ws, packed=packed)
        forward = topo.comm_stats.snapshot()
        gdn_out.backward(plan.shard(gdn_dout, packed=packed))
        gdn = {"forward": _delta(forward, {}),
               "backward": _delta(topo.comm_stats.snapshot(), forward)}  # fmt: skip
        split = (
            tuple(lengths)
            if placement == "sequence"
            else tuple(packed.assignment.lengths[d] for d in packed.assignment.split)
        )
        results.append({"attention": attention, "gdn": gdn, "split": split,
                        "ring_rank": topo.ring_rank, "sp_rank": packed_rank(plan)})  # fmt: skip
    return results


def packed_rank(plan) -> int:
    return plan.ring_rank * plan.ulysses_degree + plan.ulysses_rank


CASES = {
    (2, 2): [("sequence", "p2p", None, LENGTHS), ("documents", "p2p", None, LENGTHS),
             ("documents", "allgather", 3, LENGTHS), ("documents", "p2p", None, SHORT)],
    (1, 4): [("sequence", "allgather", None, LENGTHS), ("documents", "p2p", 5, LENGTHS)],
}  # fmt: skip


def _nonzero(traffic: dict) -> dict:
    return {
        name: {kind: c for kind, c in kinds.items() if c["sent"] or c["received"]}
        for name, kinds in traffic.items()
    }


@pytest.mark.parametrize("grid", list(CASES), ids=[f"u{u}r{r}" for u, r in CASES])
def test_counters_equal_the_formula_for_both_placements(distributed, grid):
    ulysses, ring = grid
    every_rank = distributed.run(measure, ulysses, ring, CASES[grid], world_size=4, timeout=300)
    model = types.SimpleNamespace(
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, attention_head_dim=DIM,
        num_hidden_layers=2, layer_types=["full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
    )  # fmt: skip
    for index, (placement, ring_impl, window, lengths) in enumerate(CASES[grid]):
        splits = {results[index]["split"] for results in every_rank}
        assert len(splits) == 1, splits  # every rank computed the same assignment
        (split,) = splits
        if lengths is SHORT and placement == "documents":
            assert split == ()
        elif placement == "documents":
            assert 0 < len(split) < len(lengths)
        row = place_row(lengths, placement, ring=ring, ulysses=ulysses, layout="zigzag",
                        cost=COST)  # fmt: skip
        assert row.split_lengths == split
        planned = row_bytes(row, model, ring=ring, ulysses=ulysses, layout="zigzag",
                            ring_impl=ring_impl, item_bytes=4, acc_bytes=4, gate_bytes=4,
                            state_bytes=4)  # fmt: skip
        # the benchmark's model has a window only where this case has one
        for results in every_rank:
            got = results[index]
            attention = {"forward": {}, "backward": {}}
            gdn = {"forward": {}, "backward": {}}
            if split:
                attention = _nonzero(traffic_formula(
                    types.SimpleNamespace(heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM),
                    batch=1, seqlen=sum(split), ulysses=ulysses, ring=ring,
                    ring_impl=ring_impl, item_bytes=4, acc_bytes=4, window=window,
                    layout="zigzag", doc_lengths=split if len(split) > 1 else None,
                    rank=got["ring_rank"],
                ))  # fmt: skip
                gdn = _nonzero(gdn_traffic(
                    batch=1, seqlen=sum(split), ulysses=ulysses, ring=ring, key_heads=2,
                    heads=4, key_dim=8, value_dim=8, kernel=4, layout="zigzag",
                    documents=len(split), item_bytes=4, gate_bytes=4, state_bytes=4,
                ))  # fmt: skip
            case = (placement, ring_impl, window, got["sp_rank"])
            assert got["attention"] == attention, case
            assert got["gdn"] == gdn, case
            if window is None:  # row_bytes: the same counts, summed per kind
                counted: dict[str, int] = {}
                for traffic in (got["attention"], got["gdn"]):
                    for kinds in traffic.values():
                        for kind, c in kinds.items():
                            counted[kind] = counted.get(kind, 0) + c["sent"]
                assert planned[got["sp_rank"]] == counted, case

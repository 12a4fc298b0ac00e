"""Document placement by length (``usp.Plan(..., placement="documents")``): the
assignment's arithmetic against brute force, and attention over a placed packed batch
on 4 gloo ranks (u2xr2, u1xr4, u4xr1 and dp2xr2) against a single-process float64
reference that applies the document mask, forward and backward: full attention, sliding
windows with sinks, GQA, both ring implementations and layouts, a cost model that is not
the default. Each case asserts that it placed some documents whole and split others.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from reference import (
    reference_attention,
    reference_sink_attention,
    relative_error,
    window_document_mask,
)
from usp_cases import topology

import usp
from usp.errors import ShardingError
from usp.sp.assignment import DocumentCost, assign_documents, causal_pairs, split_padding

#: 1 token up to longer than a rank's share (89 tokens, ~22 a rank on 4 ranks, ~45 on 2)
LENGTHS = [1, 3, 48, 5, 2, 9, 7, 12, 1, 1]
#: attention dominates: quadratic work, documents of every length split for balance
HEAVY = DocumentCost(token_flops=1.0, attention=((None, 4.0),))


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


# ---------------------------------------------------------------------- arithmetic
def test_causal_pairs_count_every_visible_key():
    for n, window in itertools.product(range(0, 13), (None, 1, 2, 5, 20)):
        for start in range(n + 1):
            brute = sum(min(p + 1, window or p + 1) for p in range(start, n))
            assert causal_pairs(start, n, window) == brute, (start, n, window)


def test_split_shares_add_up_to_the_whole_document():
    cost = DocumentCost(token_flops=3.0, attention=((None, 2.0), (5, 7.0)))
    for ring, ulysses, layout in [(2, 2, "zigzag"), (4, 1, "contiguous"), (1, 4, "zigzag")]:
        shares = cost.split_shares(48, ring, ulysses, layout)
        assert len(shares) == ring * ulysses
        assert sum(shares) == pytest.approx(cost.whole(48), rel=1e-12)
    # zigzag balances full causal attention exactly: every rank the same work
    shares = DocumentCost(1.0, ((None, 1.0),)).split_shares(64, 4, 2, "zigzag")
    assert max(shares) == pytest.approx(min(shares), rel=1e-12)
    # Gated DeltaNet's state pass costs more per token only when the ring splits it
    ring_cost = DocumentCost(1.0, (), linear_ring_flops=1.0)
    assert sum(ring_cost.split_shares(8, 2, 1, "zigzag")) == 16
    assert sum(ring_cost.split_shares(8, 1, 2, "zigzag")) == 8


def test_assignment_places_each_document_once_and_balances():
    bounds = [0, *itertools.accumulate(LENGTHS)]
    a = assign_documents(bounds, ring=2, ulysses=2, layout="zigzag", multiple=4,
                         cost=DocumentCost())  # fmt: skip
    placed = sorted(list(a.split) + [d for docs in a.whole for d in docs])
    assert placed == list(range(len(LENGTHS)))
    assert 2 in a.split  # the 48-token document: alone more than a rank's share
    assert len(a.split) < len(LENGTHS) // 2  # most documents stay whole
    assert all(docs == tuple(sorted(docs)) for docs in a.whole)
    tokens = [a.rank_tokens(s) for s in range(4)]
    share = a.split_tokens // 4
    assert sum(tokens) == sum(LENGTHS) and tokens == [share + a.whole_tokens(s) for s in range(4)]
    # the default cost is almost linear: whole documents balance tokens
    assert max(a.work) <= 1.25 * sum(a.work) / 4
    # the same lengths and cost give the same assignment (what every rank computes)
    again = assign_documents(bounds, ring=2, ulysses=2, layout="zigzag", multiple=4,
                             cost=DocumentCost())  # fmt: skip
    assert again == a
    # heavy attention: splitting more documents, the busiest rank within the tolerance
    heavy = assign_documents(
        [0, *itertools.accumulate([16, 16, 8, 8, 4, 4, 4, 4])], ring=2, ulysses=2,
        layout="zigzag", multiple=4, cost=HEAVY,
    )  # fmt: skip
    assert len(heavy.split) >= 2 and max(heavy.work) <= 1.02 * sum(heavy.work) / 4


def test_assignment_refusals_say_what_to_pad():
    with pytest.raises(ShardingError, match=r"document 1 \(41 tokens\).*multiple of 4"):
        assign_documents([0, 3, 44, 50], ring=2, ulysses=2, layout="zigzag", multiple=4,
                         cost=DocumentCost())  # fmt: skip
    # 63 documents of 3 tokens on 64 ranks: none too big to stay whole, one rank idle
    with pytest.raises(ShardingError, match=r"cannot give each of the 64 SP ranks a token"):
        assign_documents(list(range(0, 190, 3)), ring=8, ulysses=8, layout="zigzag",
                         multiple=64, cost=DocumentCost())  # fmt: skip


def test_split_padding_pads_only_the_split_documents():
    lengths = [5, 7, 41, 6, 6, 6, 6, 6, 6]  # whole: 2 of 6 or a 5 and a 7 on each rank
    padded = split_padding(lengths, ring=2, ulysses=2, layout="zigzag", multiple=8,
                           cost=DocumentCost())  # fmt: skip
    assert padded == [5, 7, 48, 6, 6, 6, 6, 6, 6]
    a = assign_documents([0, *itertools.accumulate(padded)], ring=2, ulysses=2,
                         layout="zigzag", multiple=8, cost=DocumentCost())  # fmt: skip
    assert a.split == (2,)


# ---------------------------------------------------------------------- attention
def run_placed_attention(ulysses, ring, cases):
    """Every case on this rank: errors of out, dq, dk, dv (and dsinks) gathered against
    the reference, what the rank holds, and its token count."""
    topo = topology(ulysses, ring)
    results = []
    for layout, ring_impl, window, cost in cases:
        plan = usp.Plan(topo, placement="documents", layout=layout, ring_impl=ring_impl,
                        backend="math", placement_cost=cost)  # fmt: skip
        padding = usp.pad_documents(cu_of(LENGTHS), plan)
        cu = padding.cu_seqlens
        total, heads, kv_heads, dim = padding.padded_len, 4, 2, 8
        gen = torch.Generator().manual_seed(7 + topo.dp_rank)  # replicas: their own batch
        q, k, v, dout = (
            torch.randn(1, total, h, dim, generator=gen, dtype=torch.float64)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        sinks = torch.randn(heads, generator=gen, dtype=torch.float64) if window else None
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
        mask = window_document_mask(cu.tolist(), window)
        if sinks is None:
            ref_out, _ = reference_attention(*ref, mask=mask)
        else:
            ref_out = reference_sink_attention(*ref, ref_sinks, mask=mask)
        wrt = ref + ([ref_sinks] if sinks is not None else [])
        expected = [ref_out.detach(), *torch.autograd.grad(ref_out, wrt, dout)]

        packed = plan.pack(cu)
        local = [plan.shard(t, packed=packed).requires_grad_() for t in (q, k, v)]
        local_sinks = None if sinks is None else sinks.clone().requires_grad_()
        out = plan.attention(*local, causal=True, packed=packed, window=window, sinks=local_sinks)
        out.backward(plan.shard(dout, packed=packed))
        actual = [plan.gather(t, packed=packed) for t in (out.detach(), *(x.grad for x in local))]
        if local_sinks is not None:
            dsinks = local_sinks.grad.clone()
            dist.all_reduce(dsinks, group=plan.sp_group)
            actual.append(dsinks)
        positions = plan.position_ids(total, packed=packed)
        results.append({
            "errors": [relative_error(a, e) for a, e in zip(actual, expected)],
            "split": packed.assignment.split, "whole": packed.whole is not None,
            "tokens": packed.local_len, "positions_ok": torch.equal(
                positions, packed.position_ids[plan.token_indices(total, packed=packed)]),
        })  # fmt: skip
    return results


CASES = {
    (2, 2): [("zigzag", "p2p", None, None), ("contiguous", "allgather", 3, None),
             ("zigzag", "p2p", 4, HEAVY)],
    (1, 4): [("zigzag", "p2p", 5, None), ("contiguous", "p2p", None, HEAVY)],
    (4, 1): [("zigzag", "p2p", None, None), ("contiguous", "p2p", 2, None)],
    (1, 2): [("zigzag", "allgather", None, None), ("zigzag", "p2p", 3, HEAVY)],  # dp 2
}  # fmt: skip


@pytest.mark.parametrize("grid", list(CASES), ids=[f"u{u}r{r}" for u, r in CASES])
def test_placed_attention_matches_reference(distributed, grid):
    results = distributed.run(run_placed_attention, *grid, CASES[grid], world_size=4, timeout=300)
    failures = []
    for rank, cases in enumerate(results):
        for case, result in zip(CASES[grid], cases):
            assert result["split"], (case, "nothing split: the case tests one path only")
            assert result["positions_ok"], case
            for name, err in zip(("out", "dq", "dk", "dv", "dsinks"), result["errors"]):
                if not err <= 1e-10:
                    failures.append(f"{case} rank {rank} {name}: {err:.3g}")
    # some rank computed whole documents in every case, and ranks hold different counts
    for index, case in enumerate(CASES[grid]):
        assert any(cases[index]["whole"] for cases in results), case
    assert not failures, "\n".join(failures)

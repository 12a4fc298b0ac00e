"""Mamba-1's selective scan (Jamba's) under hybrid SP (issue 57): ``usp.linear.mamba1_usp``
in one process against a token-by-token float64 reference and transformers' scan; on 4
gloo ranks (u1r4, u2r2, u4r1; zigzag and contiguous; dense and packed) against the
one-process reference, forward and every gradient (x, dt, A, B, C, D); the traffic
against ``usp.planner.mixer_traffic.mamba1_traffic``; refusals on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mamba_cases import mamba1_inputs, reference_mamba1
from mixer_grid import bytes_sent, grid_failures
from reference import relative_error
from refusal_cases import assert_same_refusals, refusal_messages
from usp_cases import topology

import usp
from usp.linear import mamba1_usp
from usp.planner.mixer_traffic import mamba1_traffic

TIMEOUT = 120
CHANNELS, STATE = 8, 5
NAMES = ["dx", "ddt", "da", "db", "dc", "dd"]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_one_process_matches_the_recurrence_with_documents():
    inputs, dout = mamba1_inputs(2, 29, CHANNELS, STATE, seed=1)
    for packed, chunk_size, skip in ((None, 64, True), (_cu([3, 1, 13, 12]), 4, False)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        d = leaves[5] if skip else None
        out = mamba1_usp(*leaves[:5], None, d=d, packed=packed, chunk_size=chunk_size)
        ref_leaves = [t.clone().requires_grad_() for t in inputs]
        ref = reference_mamba1(*ref_leaves[:5], ref_leaves[5] if skip else None, packed)
        assert relative_error(out, ref) < 1e-12
        used = leaves if skip else leaves[:5]
        grads = torch.autograd.grad(out, used, dout)
        expected = torch.autograd.grad(ref, ref_leaves if skip else ref_leaves[:5], dout)
        for got, want in zip(grads, expected):
            assert relative_error(got, want) < 1e-11


def test_the_scan_matches_transformers_jamba_scan_in_float32():
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    (x, dt, a, b, c, d), _ = mamba1_inputs(2, 70, CHANNELS, STATE, seed=3, dtype=torch.float32)
    mine = mamba1_usp(x, dt, a, b, c, None, d=d, chunk_size=16)
    theirs = jamba.mamba_selective_scan(x.transpose(1, 2), dt.transpose(1, 2), a,
                                        b.transpose(1, 2), c.transpose(1, 2), D=d)  # fmt: skip
    assert mine.dtype == torch.float32
    assert relative_error(mine, theirs.transpose(1, 2)) < 2e-5


def run_mamba1_case(ulysses, ring, layout, packed, seed):
    topo = topology(ulysses, ring)
    plan = usp.Plan(topo, layout=layout)
    if packed:
        cu = usp.pad_documents(_cu([5, 1, 17, 3, 9]), topo, layout=layout).cu_seqlens
        batch, seq_len = 1, int(cu[-1])
    else:
        cu, batch, seq_len = None, 2, 4 * ring * 2 * 3
    inputs, dout = mamba1_inputs(batch, seq_len, CHANNELS, STATE, seed=seed)
    skip = seed % 2 == 0
    ref_leaves = [t.clone().requires_grad_() for t in inputs]
    expected = reference_mamba1(*ref_leaves[:5], ref_leaves[5] if skip else None, cu)
    wanted = ref_leaves if skip else ref_leaves[:5]
    expected_grads = torch.autograd.grad(expected, wanted, dout)

    x, dt = (plan.shard(t, packed=cu).requires_grad_() for t in inputs[:2])
    a = inputs[2].clone().requires_grad_()
    b, c = (plan.shard(t, packed=cu).requires_grad_() for t in inputs[3:5])
    d = inputs[5].clone().requires_grad_() if skip else None
    topo.comm_stats.reset()
    out = mamba1_usp(x, dt, a, b, c, plan, d=d, packed=cu, chunk_size=3)
    forward = topo.comm_stats.snapshot()
    out.backward(plan.shard(dout, packed=cu))
    total = topo.comm_stats.snapshot()
    backward = {kind: {n: v - forward.get(kind, {}).get(n, 0) for n, v in counts.items()}
                for kind, counts in total.items()}  # fmt: skip
    grads = [plan.gather(t.grad, packed=cu) for t in (x, dt)]
    dist.all_reduce(a.grad, group=topo.sp_group)  # a replicated parameter: the sum
    grads.append(a.grad)
    grads += [plan.gather(t.grad, packed=cu) for t in (b, c)]
    if d is not None:
        dist.all_reduce(d.grad, group=topo.sp_group)
        grads.append(d.grad)
    errors = {"out": relative_error(plan.gather(out.detach(), packed=cu), expected)}
    errors.update({n: relative_error(g, e) for n, g, e in zip(NAMES, grads, expected_grads)})
    docs = 1 if cu is None else len(plan.pack(cu, agree_ranks=False).documents.lengths)
    planned = mamba1_traffic(
        batch=batch, seqlen=seq_len, ulysses=ulysses, ring=ring, channels=CHANNELS,
        state_size=STATE, layout=layout, documents=docs, item_bytes=8, state_bytes=8,
    )  # fmt: skip
    sent, formula = bytes_sent(forward, backward, planned)
    return errors, sent, formula


GRIDS = [(1, 4), (2, 2), (4, 1)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"u{u}r{r}" for u, r in GRIDS])
def test_mamba1_usp_matches_one_process(distributed, grid):
    failures = grid_failures(distributed, run_mamba1_case, grid, 1e-10, TIMEOUT)
    assert not failures, "\n".join(failures)


def run_refusals():
    topo = topology(4, 1)
    plan = usp.Plan(topo, layout="zigzag")
    rank = dist.get_rank()
    (x, dt, a, b, c, d), _ = mamba1_inputs(1, 16, CHANNELS, STATE, seed=2)
    x, dt, b, c = (plan.shard(t) for t in (x, dt, b, c))
    calls = {
        "channels": lambda: mamba1_usp(x[..., :6], dt[..., :6], a[:6], b, c, plan),
        "a": lambda: mamba1_usp(x, dt, a[:, :2], b, c, plan),
        "kernel": lambda: mamba1_usp(x, dt, a, b, c, plan, kernel="fla"),
        "shape_on_one_rank": lambda: mamba1_usp(
            x, dt, a, b[..., :2] if rank == 3 else b, c[..., :2] if rank == 3 else c, plan
        ),  # fmt: skip
        "placed_documents": lambda: mamba1_usp(
            x,
            dt,
            a,
            b,
            c,
            usp.Plan(topo, layout="zigzag", placement="documents"),
            packed=torch.tensor([0, 4, 16], dtype=torch.int32),
        ),  # fmt: skip
    }
    messages = refusal_messages(calls, topo.comm_stats)
    dist.barrier()
    return messages


EXPECTED = {
    "channels": ("Mamba1Error", "6 channels do not split over ulysses=4"),
    "a": ("Mamba1Error", "a must be [D, N] = (8, 5)"),
    "kernel": ("Mamba1Error", "no fla kernel is mapped for it"),
    "shape_on_one_rank": ("Mamba1Error", "mamba1_usp failed on rank 3 of 4"),
    "placed_documents": ("Mamba1Error", "mamba1_usp does not place documents by length yet"),
}


def test_refusals_are_the_same_on_every_rank_before_any_traffic(distributed):
    results = distributed.run(run_refusals, world_size=4, timeout=60)
    assert_same_refusals(results, EXPECTED)

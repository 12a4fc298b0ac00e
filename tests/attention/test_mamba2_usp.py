"""Mamba-2 (SSD) under hybrid SP (issue 57): ``usp.linear.mamba2_usp`` in one process
against a token-by-token float64 reference and transformers' chunk scan; on 4 gloo ranks
(u1r4, u2r2, u4r1; zigzag and contiguous; dense and packed) against the one-process
reference, forward and every gradient (x, B, C, dt, A, D, conv weight and bias); the
traffic against the formula in docs/models.md; refusals on every rank before any traffic.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mamba_cases import mamba_inputs, reference_mamba2
from reference import relative_error
from usp_cases import topology

import usp
from usp.linear.mamba2 import mamba2_usp

TIMEOUT = 120
HEADS, GROUPS, HEAD_DIM, STATE, KERNEL = 4, 2, 6, 5, 4


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_one_process_matches_the_recurrence_with_documents():
    inputs, dout = mamba_inputs(2, 29, HEADS, GROUPS, HEAD_DIM, STATE, KERNEL, seed=1)
    cu = _cu([3, 1, 13, 12])  # documents shorter than the conv, and one of one token
    for packed, activation, chunk_size in ((None, "silu", 64), (cu, None, 5)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        x, b, c, dt, a, d, w, bias = leaves
        out = mamba2_usp(x, b, c, dt, a, None, d=d, conv_weight=w, conv_bias=bias,
                         packed=packed, activation=activation, chunk_size=chunk_size)  # fmt: skip
        ref_leaves = [t.clone().requires_grad_() for t in inputs]
        ref = reference_mamba2(*ref_leaves, cu_seqlens=packed, activation=activation)
        assert relative_error(out, ref) < 1e-12
        grads = torch.autograd.grad(out, leaves, dout)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
        for got, expected in zip(grads, ref_grads):
            assert relative_error(got, expected) < 1e-11


def test_the_scan_matches_transformers_chunk_scan_in_float32():
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    inputs, _ = mamba_inputs(2, 70, HEADS, GROUPS, HEAD_DIM, STATE, 1, seed=3, dtype=torch.float32)
    x, b, c, dt, a, d, _, _ = inputs
    identity = torch.ones(HEADS * HEAD_DIM + 2 * GROUPS * STATE, 1)  # a conv of width 1: none
    mine = mamba2_usp(x, b, c, dt, a, None, d=d, conv_weight=identity, activation=None)
    theirs = bamba.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=16, D=d)
    assert mine.dtype == torch.float32
    assert relative_error(mine, theirs) < 2e-5


def expected_bytes(u, r, layout, docs, batch, seq_len):
    """docs/models.md's formula (float64 everywhere here: 8-byte elements): the forward's
    all-to-all and all-gather bytes one rank sends (the backward sends the same)."""
    e, times = 8, max(1, u // GROUPS)  # groups repeated to lcm(G, u)
    group_channels = 2 * GROUPS * times * STATE
    tokens = batch * seq_len // (u * r)
    a2a = tokens * (HEADS * HEAD_DIM + group_channels + HEADS) * e * (u - 1) // u
    a2a += tokens * HEADS * HEAD_DIM * e * (u - 1) // u
    segments = (2 if layout == "zigzag" else 1) * docs
    ring = 0
    if r > 1:
        tails = (KERNEL - 1) * (HEADS * HEAD_DIM + group_channels) // u
        maps = HEADS // u * (STATE * HEAD_DIM + 1)
        ring = (r - 1) * batch * segments * (tails + maps) * e
    return a2a, ring


def run_mamba2_case(ulysses, ring, layout, packed, seed):
    topo = topology(ulysses, ring)
    plan = usp.Plan(topo, layout=layout)
    if packed:
        cu = usp.pad_documents(_cu([5, 1, 17, 3, 9]), topo, layout=layout).cu_seqlens
        batch, seq_len = 1, int(cu[-1])
    else:
        cu, batch, seq_len = None, 2, 4 * ring * 2 * 3
    inputs, dout = mamba_inputs(batch, seq_len, HEADS, GROUPS, HEAD_DIM, STATE, KERNEL,
                                seed=seed, bias=seed % 2 == 0)  # fmt: skip
    activation = "silu" if seed % 3 else None
    ref_leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    expected = reference_mamba2(*ref_leaves, cu_seqlens=cu, activation=activation)
    wanted = [t for t in ref_leaves if t is not None]
    expected_grads = torch.autograd.grad(expected, wanted, dout)

    x, b, c, dt = (plan.shard(t, packed=cu).requires_grad_() for t in inputs[:4])
    params = [None if t is None else t.clone().requires_grad_() for t in inputs[4:]]
    topo.comm_stats.reset()
    out = mamba2_usp(x, b, c, dt, params[0], plan, d=params[1], conv_weight=params[2],
                     conv_bias=params[3], packed=cu, activation=activation, chunk_size=3)  # fmt: skip
    forward = topo.comm_stats.snapshot()
    out.backward(plan.shard(dout, packed=cu))
    total = topo.comm_stats.snapshot()
    backward = {k: {n: v - forward.get(k, {}).get(n, 0) for n, v in counts.items()}
                for k, counts in total.items()}  # fmt: skip
    grads = [plan.gather(t.grad, packed=cu) for t in (x, b, c, dt)]
    for p in params:
        if p is not None:  # a replicated parameter's gradient: the sum over the SP ranks
            dist.all_reduce(p.grad, group=topo.sp_group)
            grads.append(p.grad)
    errors = {"out": relative_error(plan.gather(out.detach(), packed=cu), expected)}
    names = ["dx", "db", "dc", "ddt", "da", "dd", "dweight", "dbias"]
    errors.update({n: relative_error(g, e) for n, g, e in zip(names, grads, expected_grads)})
    docs = 1 if cu is None else len(plan.pack(cu, agree_ranks=False).documents.lengths)
    sent = {kind: counts.get("sent", 0) for kind, counts in forward.items()}
    back = {kind: counts.get("sent", 0) for kind, counts in backward.items()}
    return errors, sent, back, (docs, batch, seq_len)


GRIDS = [(1, 4), (2, 2), (4, 1)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"u{u}r{r}" for u, r in GRIDS])
def test_mamba2_usp_matches_one_process(distributed, grid):
    failures = []
    cases = [("zigzag", False), ("contiguous", True), ("zigzag", True)]
    for seed, case in enumerate(cases):
        results = distributed.run(run_mamba2_case, *grid, *case, seed, world_size=4,
                                  timeout=TIMEOUT)  # fmt: skip
        for rank, (errors, sent, back, shape) in enumerate(results):
            failures += [f"{grid} {case} r{rank} {n}: {e:.3g}" for n, e in errors.items()
                         if not e < 1e-10]  # fmt: skip
            a2a, ring = expected_bytes(*grid, case[0], *shape)
            got = (sent.get("all_to_all", 0), sent.get("all_gather", 0))
            if got != (a2a, ring):
                failures.append(f"{grid} {case} r{rank} forward bytes {got} != {(a2a, ring)}")
            got = (back.get("all_to_all", 0), back.get("reduce_scatter", 0))
            if got != (a2a, ring):
                failures.append(f"{grid} {case} r{rank} backward bytes {got} != {(a2a, ring)}")
    assert not failures, "\n".join(failures)

"""Kimi Delta Attention under hybrid SP (issue 57): ``usp.linear.kda_usp`` in one process
against a token-by-token float64 reference (a decay per key channel) and transformers'
chunked KDA; on 4 gloo ranks (u1r4, u2r2, u4r1; zigzag and contiguous; dense and packed;
key heads repeated when u does not divide them) against the one-process reference,
forward and every gradient (q, k, v, g, beta, the conv weights); the traffic against
``usp.planner.mixer_traffic.kda_traffic``; refusals on every rank before any traffic.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from kda_cases import kda_inputs, reference_kda
from mixer_grid import bytes_sent, grid_failures
from reference import relative_error
from refusal_cases import assert_same_refusals, refusal_messages
from usp_cases import topology

import usp
from usp.linear import kda_usp
from usp.planner.mixer_traffic import kda_traffic

TIMEOUT = 120
DK, DV, KERNEL = 6, 5, 4
NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dwq", "dwk", "dwv"]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


def test_one_process_matches_the_recurrence_with_documents():
    """Documents shorter than the conv and one of one token; every option off its
    default in one of the cases (no conv, no activation, no l2 norm, a scale, chunks)."""
    inputs, ws, dout = kda_inputs(2, 29, 2, 4, DK, DV, KERNEL, seed=1)
    cu = _cu([3, 1, 13, 12])
    cases = [
        dict(packed=None, chunk_size=64, conv=True),
        dict(packed=cu, chunk_size=5, conv=True, activation=None, scale=0.7),
        dict(packed=cu, chunk_size=1, conv=False, use_qk_l2norm=False, scale=0.2),
    ]
    for case in cases:
        conv = case.pop("conv")
        leaves = [t.clone().requires_grad_() for t in inputs + (ws if conv else [])]
        out = kda_usp(*leaves[:5], None, conv_weights=leaves[5:] or None, **case)
        ref_leaves = [t.clone().requires_grad_() for t in inputs + (ws if conv else [])]
        options = {k: case[k] for k in ("activation", "scale", "use_qk_l2norm") if k in case}
        ref = reference_kda(*ref_leaves[:5], ref_leaves[5:] or None, case["packed"], **options)
        assert relative_error(out, ref) < 1e-12, case
        for got, expected in zip(_grads(out, leaves, dout), _grads(ref, ref_leaves, dout)):
            assert relative_error(got, expected) < 1e-11, case


def test_the_kernel_matches_transformers_chunked_kda_in_float32():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    (q, k, v, g, beta), _, _ = kda_inputs(2, 70, 4, 4, 16, 8, 1, seed=3, dtype=torch.float32)
    mine = kda_usp(q, k, v, g, beta, None, chunk_size=16)
    theirs, _ = kimi.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=16,
                                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert mine.dtype == torch.float32
    assert relative_error(mine, theirs) < 2e-5


def run_kda_case(ulysses, ring, layout, packed, seed):
    topo = topology(ulysses, ring)
    plan = usp.Plan(topo, layout=layout)
    hk, heads = (1, 4) if ulysses == 4 else (2, 4)  # u4: key heads repeated for the split
    if packed:
        cu = usp.pad_documents(_cu([5, 1, 17, 3, 9]), topo, layout=layout).cu_seqlens
        batch, seq_len = 1, int(cu[-1])
    else:
        cu, batch, seq_len = None, 2, 4 * ring * 2 * 3
    inputs, ws, dout = kda_inputs(batch, seq_len, hk, heads, DK, DV, KERNEL, seed=seed)
    activation = "silu" if seed % 2 else None
    ref_leaves = [t.clone().requires_grad_() for t in inputs + ws]
    expected = reference_kda(*ref_leaves[:5], ref_leaves[5:], cu, activation=activation)
    expected_grads = _grads(expected, ref_leaves, dout)

    local = [plan.shard(t, packed=cu).requires_grad_() for t in inputs]
    my_ws = [w.clone().requires_grad_() for w in ws]
    topo.comm_stats.reset()
    out = kda_usp(*local, plan, conv_weights=my_ws, packed=cu, activation=activation,
                  chunk_size=3)  # fmt: skip
    forward = topo.comm_stats.snapshot()
    out.backward(plan.shard(dout, packed=cu))
    total = topo.comm_stats.snapshot()
    backward = {kind: {n: c - forward.get(kind, {}).get(n, 0) for n, c in counts.items()}
                for kind, counts in total.items()}  # fmt: skip
    grads = [plan.gather(t.grad, packed=cu) for t in local]
    for w in my_ws:  # a replicated weight's gradient: the sum over the SP ranks
        dist.all_reduce(w.grad, group=topo.sp_group)
        grads.append(w.grad)
    errors = {"out": relative_error(plan.gather(out.detach(), packed=cu), expected)}
    errors.update({n: relative_error(a, e) for n, a, e in zip(NAMES, grads, expected_grads)})
    docs = 1 if cu is None else len(plan.pack(cu, agree_ranks=False).documents.lengths)
    planned = kda_traffic(
        batch=batch, seqlen=seq_len, ulysses=ulysses, ring=ring, key_heads=hk, heads=heads,
        key_dim=DK, value_dim=DV, kernel=KERNEL, layout=layout, documents=docs, item_bytes=8,
        gate_bytes=8, state_bytes=8,
    )  # fmt: skip
    sent, formula = bytes_sent(forward, backward, planned)
    return errors, sent, formula


GRIDS = [(1, 4), (2, 2), (4, 1)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"u{u}r{r}" for u, r in GRIDS])
def test_kda_usp_matches_one_process(distributed, grid):
    failures = grid_failures(distributed, run_kda_case, grid, 1e-10, TIMEOUT)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ refusals
def run_refusals():
    """Each bad call raises the same error on every rank and moves no bytes; a valid call
    after them is exact."""
    topo = topology(2, 2)
    plan = usp.Plan(topo, layout="contiguous")
    rank = dist.get_rank()
    inputs, ws, _ = kda_inputs(1, 16, 2, 4, DK, DV, KERNEL, seed=9)
    local = [plan.shard(t) for t in inputs]
    q, k, v, g, beta = local
    odd, _, _ = kda_inputs(1, 16, 3, 3, DK, DV, KERNEL, seed=9)  # 3 value heads over u=2
    calls = {
        "per_head_decay": lambda: kda_usp(q, k, v, g[..., 0], beta, plan),
        "heads": lambda: kda_usp(*[plan.shard(t) for t in odd], plan),
        "shape_on_one_rank": lambda: kda_usp(*[t[:, :2] if rank == 3 else t for t in local], plan),
        "kernel": lambda: kda_usp(*local, plan, kernel="fla"),  # fla runs on CUDA only
        "grad_on_one_rank": lambda: kda_usp(
            q, k, v.clone().requires_grad_(rank == 2), g, beta, plan
        ),
        "scale": lambda: kda_usp(*local, plan, scale=float("nan")),
        "placed_documents": lambda: kda_usp(
            *local,
            usp.Plan(topo, layout="contiguous", placement="documents"),
            packed=torch.tensor([0, 4, 16], dtype=torch.int32),
        ),  # fmt: skip
    }
    messages = refusal_messages(calls, topo.comm_stats)
    out = kda_usp(*local, plan, conv_weights=ws)
    error = relative_error(plan.gather(out), reference_kda(*inputs, ws))
    dist.barrier()
    return messages, error


EXPECTED = {
    "per_head_decay": ("KdaError", "kda_usp failed on ranks 0, 1, 2, 3", "decay per key channel"),
    "heads": ("UlyssesHeadError", "cannot split 3 KDA value heads"),
    "shape_on_one_rank": ("RankDisagreementError", "disagree on shapes of q, k, v, g, beta"),
    "kernel": ("GdnKernelError", "KDA kernel 'fla' cannot run this call (cpu"),
    "grad_on_one_rank": ("RankDisagreementError", "disagree on needs_grad", "rank 2: v requires"),
    "scale": ("KdaError", "scale must be a finite number > 0"),
    "placed_documents": ("KdaError", "kda_usp does not place documents by length yet"),
}


def test_refusals_are_the_same_on_every_rank_before_any_traffic(distributed):
    results = distributed.run(run_refusals, world_size=4, timeout=60)
    assert_same_refusals([messages for messages, _ in results], EXPECTED)
    assert all(error < 1e-10 for _, error in results)

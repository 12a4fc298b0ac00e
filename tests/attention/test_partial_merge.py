"""A partial attention result merged into USP attention (``plan.attention(...,
partial=(out, lse))``, :mod:`usp.ring.partial`): causal attention whose rows inside
"blocks" also see the later keys of their block (Gemma 3's image blocks), the later keys'
part computed outside (here by the independent reference) and merged by the ring.

Against one float64 reference attention with the whole mask: out and the gradients of
q, k, v (summed over the SP ranks: the partial's own autograd reaches the global
tensors on every rank), in one process and on 4 gloo ranks (u2 x r2 zigzag p2p, u1 x r4
contiguous all-gather, u4 x r1), with and without a sliding window. Tolerance 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention, reference_mask, relative_error
from usp_cases import topology

import usp
from usp.kernels.spec import AttentionInputError

TOL = 1e-10
SEQ, HEADS, KV_HEADS, DIM = 32, 4, 2, 8
BLOCKS = [(3, 9), (14, 15), (20, 29)]  # [start, end): bidirectional inside each


def _masks(window):
    base = reference_mask(SEQ, SEQ, True, None if window is None else window - 1)
    later = torch.zeros(SEQ, SEQ, dtype=torch.bool)
    for a, b in BLOCKS:
        later[a:b, a:b] = True
    later &= ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))  # keys after the query
    return base | later, later


def _inputs():
    gen = torch.Generator().manual_seed(3)
    shapes = [(1, SEQ, HEADS, DIM), (1, SEQ, KV_HEADS, DIM), (1, SEQ, KV_HEADS, DIM)]
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    return q, k, v, torch.randn(1, SEQ, HEADS, DIM, generator=gen, dtype=torch.float64)


def _case(plan, window):
    full, later = _masks(window)
    q, k, v, dout = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_attention(*leaves, mask=full)
    expected_grads = torch.autograd.grad(expected, leaves, dout)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    p_out, p_lse = reference_attention(q, k, v, mask=later)  # [1, S, H, D], [1, H, S]
    local = [plan.shard(t) for t in (q, k, v)]
    partial = (plan.shard(p_out), plan.shard(p_lse.transpose(1, 2)))  # [1, S/P, H(, D)]
    out = plan.attention(*local, causal=True, window=window, partial=partial)
    out.backward(plan.shard(dout))
    grads = [t.grad for t in (q, k, v)]
    if plan.sp_degree > 1:
        for g in grads:
            dist.all_reduce(g, group=plan.sp_group)
        got = plan.gather(out.detach())
    else:
        got = out.detach()
    errors = {"out": relative_error(got, expected.detach())}
    errors.update({n: relative_error(g, e) for n, g, e in zip("qkv", grads, expected_grads)})
    return errors


@pytest.mark.parametrize("window", [None, 6])
def test_partial_merge_in_one_process(window):
    errors = _case(usp.Plan(None), window)
    assert max(errors.values()) < TOL, errors


def run_partial_merge():
    results = []
    for (u, r), options in (
        ((2, 2), dict(layout="zigzag", ring_impl="p2p")),
        ((1, 4), dict(layout="contiguous", ring_impl="allgather")),
        ((4, 1), dict(layout="zigzag")),
    ):
        plan = usp.Plan(topology(u, r), **options)
        for window in (None, 6):
            results.append(((u, r, window), _case(plan, window)))
    return results


def test_partial_merge_under_sp(distributed):
    results = distributed.run(run_partial_merge, world_size=4, timeout=300)
    failures = [
        f"rank {rank} {case}: {errors}"
        for rank, cases in enumerate(results)
        for case, errors in cases
        if not max(errors.values()) < TOL
    ]
    assert not failures, "\n".join(failures)


def test_partial_of_the_wrong_shape_is_refused():
    q, k, v, _ = _inputs()
    bad = (torch.zeros(1, SEQ, HEADS, DIM, dtype=torch.float64), torch.zeros(1, SEQ, 1))
    with pytest.raises(AttentionInputError, match=r"partial lse must have shape \[1, 32, 4\]"):
        usp.Plan(None).attention(q, k, v, causal=True, partial=bad)

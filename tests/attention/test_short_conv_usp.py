"""The short conv alone under hybrid SP (issue 57, LFM2's mixer): ``usp.linear.short_conv_usp``
in one process and on 4 gloo ranks (u1r4, u2r2, u4r1; zigzag and contiguous; dense and
packed, documents shorter than the conv) against ``F.conv1d`` per document in float64,
forward and every gradient (x, weight, bias); the traffic against
``usp.planner.mixer_traffic.short_conv_traffic``; refusals on every rank before any traffic.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mixer_grid import bytes_sent, grid_failures
from reference import relative_error
from refusal_cases import assert_same_refusals, refusal_messages
from usp_cases import topology

import usp
from usp.linear import short_conv_usp
from usp.planner.mixer_traffic import short_conv_traffic

TIMEOUT = 120
CHANNELS, KERNEL = 8, 4


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def conv_inputs(batch, seq_len, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, dout = randn(batch, seq_len, CHANNELS), randn(batch, seq_len, CHANNELS)
    return [x, randn(CHANNELS, KERNEL) * 0.5, randn(CHANNELS) * 0.3 if bias else None], dout


def reference_conv(x, weight, bias, cu_seqlens=None, activation=None):
    """F.conv1d with zero padding, one document at a time."""
    bounds = [0, x.shape[1]] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        y = F.conv1d(x[:, a:b].transpose(1, 2), weight[:, None], bias,
                     padding=weight.shape[1] - 1, groups=weight.shape[0])[..., : b - a]  # fmt: skip
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, dim=1)
    return F.silu(y) if activation == "silu" else y


def test_one_process_matches_the_reference():
    inputs, dout = conv_inputs(2, 29, seed=1)
    for packed, activation, bias in ((None, None, True), (_cu([3, 1, 13, 12]), "silu", False)):
        leaves = [t.clone().requires_grad_() for t in inputs[:2]]
        leaves.append(inputs[2].clone().requires_grad_() if bias else None)
        out = short_conv_usp(leaves[0], None, weight=leaves[1], bias=leaves[2], packed=packed,
                             activation=activation)  # fmt: skip
        ref_leaves = [None if t is None else t.clone().requires_grad_() for t in leaves]
        ref = reference_conv(*ref_leaves, packed, activation)
        assert relative_error(out, ref) < 1e-13
        used = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(out, used, dout)
        expected = torch.autograd.grad(ref, [t for t in ref_leaves if t is not None], dout)
        assert all(relative_error(a, e) < 1e-13 for a, e in zip(grads, expected))


def run_conv_case(ulysses, ring, layout, packed, seed):
    topo = topology(ulysses, ring)
    plan = usp.Plan(topo, layout=layout)
    if packed:  # documents of 1 and 2 tokens: shorter than the conv's reach
        cu = usp.pad_documents(_cu([5, 1, 17, 2, 9]), topo, layout=layout).cu_seqlens
        batch, seq_len = 1, int(cu[-1])
    else:
        cu, batch, seq_len = None, 2, 4 * ring * 2 * 3
    inputs, dout = conv_inputs(batch, seq_len, seed, bias=seed % 2 == 0)
    activation = "silu" if seed % 3 else None
    ref_leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    expected = reference_conv(*ref_leaves, cu, activation)
    expected_grads = torch.autograd.grad(expected, [t for t in ref_leaves if t is not None], dout)

    x = plan.shard(inputs[0], packed=cu).requires_grad_()
    params = [None if t is None else t.clone().requires_grad_() for t in inputs[1:]]
    topo.comm_stats.reset()
    out = short_conv_usp(x, plan, weight=params[0], bias=params[1], packed=cu,
                         activation=activation)  # fmt: skip
    forward = topo.comm_stats.snapshot()
    out.backward(plan.shard(dout, packed=cu))
    total = topo.comm_stats.snapshot()
    backward = {kind: {n: c - forward.get(kind, {}).get(n, 0) for n, c in counts.items()}
                for kind, counts in total.items()}  # fmt: skip
    grads = [plan.gather(x.grad, packed=cu)]
    for p in params:
        if p is not None:  # a replicated parameter's gradient: the sum over the SP ranks
            dist.all_reduce(p.grad, group=topo.sp_group)
            grads.append(p.grad)
    errors = {"out": relative_error(plan.gather(out.detach(), packed=cu), expected)}
    errors.update({n: relative_error(g, e) for n, g, e in
                   zip(["dx", "dweight", "dbias"], grads, expected_grads)})  # fmt: skip
    docs = 1 if cu is None else len(plan.pack(cu, agree_ranks=False).documents.lengths)
    planned = short_conv_traffic(
        batch=batch, seqlen=seq_len, ulysses=ulysses, ring=ring, channels=CHANNELS,
        kernel=KERNEL, layout=layout, documents=docs, item_bytes=8, state_bytes=8,
    )  # fmt: skip
    sent, formula = bytes_sent(forward, backward, planned)
    return errors, sent, formula


GRIDS = [(1, 4), (2, 2), (4, 1)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"u{u}r{r}" for u, r in GRIDS])
def test_short_conv_usp_matches_one_process(distributed, grid):
    failures = grid_failures(distributed, run_conv_case, grid, 1e-12, TIMEOUT)
    assert not failures, "\n".join(failures)


def run_refusals():
    """Each bad call raises the same error on every rank and moves no bytes."""
    topo = topology(4, 1)
    plan = usp.Plan(topo, layout="zigzag")
    rank = dist.get_rank()
    (x, weight, bias), _ = conv_inputs(1, 16, seed=2)
    local = plan.shard(x)
    calls = {
        "channels": lambda: short_conv_usp(local[..., :6], plan, weight=weight[:6]),
        "weight": lambda: short_conv_usp(local, plan, weight=weight[:, None]),
        "shape_on_one_rank": lambda: short_conv_usp(
            local[:, :2] if rank == 3 else local, plan, weight=weight
        ),  # fmt: skip
        "bias_on_one_rank": lambda: short_conv_usp(
            local, plan, weight=weight, bias=bias if rank == 1 else None
        ),  # fmt: skip
        "kernel": lambda: short_conv_usp(local, plan, weight=weight, conv_kernel="causal_conv1d"),
        "placed_documents": lambda: short_conv_usp(
            local,
            usp.Plan(topo, layout="zigzag", placement="documents"),
            weight=weight,
            packed=torch.tensor([0, 4, 16], dtype=torch.int32),
        ),  # fmt: skip
    }
    messages = refusal_messages(calls, topo.comm_stats)
    dist.barrier()
    return messages


EXPECTED = {
    "channels": ("ShortConvError", "6 channels do not split over ulysses=4"),
    "weight": ("ShortConvError", "weight [C, K >= 1]"),
    "shape_on_one_rank": ("RankDisagreementError", "disagree on shapes of x, weight and bias"),
    "bias_on_one_rank": ("RankDisagreementError", "disagree on shapes of x, weight and bias"),
    "kernel": ("ConvKernelError", "conv kernel 'causal_conv1d' cannot run this call (cpu"),
    "placed_documents": ("ShortConvError", "short_conv_usp does not place documents by length"),
}


def test_refusals_are_the_same_on_every_rank_before_any_traffic(distributed):
    results = distributed.run(run_refusals, world_size=4, timeout=60)
    assert_same_refusals(results, EXPECTED)

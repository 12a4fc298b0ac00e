"""What the p2p ring's backward holds at its peak: one rank of a ring of 4 on the
``fake`` process group, under fake tensors with torch's MemTracker (the planner's
tools), against the contract in ``usp.ring.p2p.p2p_backward``'s docstring: the inputs,
the float32 dQ, ``own`` and two ``travelling`` dK/dV accumulators, two K/V blocks, one
kernel call's outputs and two LSE-sized slices, nothing more -- besides the kernel's own
working memory during a call, which the planning kernels allocate (since usp plan counts
kernel workspaces: ``usp.planner.overheads.attention_workspace``).

Measured (bytes, L=256, H=8, Hkv=2, D=16; before the buffers were dropped early ->
after): float32 zigzag 1,265,664 -> 1,069,056, contiguous 1,187,840 -> 999,424; bf16
zigzag 806,912 -> 708,608, contiguous 827,392 -> 630,784. Each "before" exceeds the
bound below (the last step's kernel outputs, the spare K/V buffer and the accumulators
were alive through the final casts), each "after" is within it. With the kernel's
workspace counted (one thread), 2026-12-02: float32 1,134,720 and 1,130,752, bf16
1,069,184 and 1,065,216.
"""

import os
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import usp
from usp.kernels.backends import registry
from usp.kernels.masks import accumulation_dtype
from usp.planner.kernels import planning_kernels
from usp.planner.overheads import attention_workspace
from usp.process_groups.fake import fake_world
from usp.ring.api import ring_attention

L, H, HKV, D, RING = 256, 8, 2, 16, 4


def backward_peak(dtype, layout) -> int:
    with fake_world(RING, 0, torch.device("cpu")):
        topo = usp.build_topology(1, RING, ranks_per_node=RING, device_type="cpu")
        try:
            # ring_attention looks its kernels up in usp's registry: the planning one
            # stands in for it here (a Plan would take it as kernel_registry=)
            planning, _ = planning_kernels()
            with mock.patch.object(registry, "DEFAULT", planning), FakeTensorMode():
                q = torch.randn(1, L, H, D, dtype=dtype, requires_grad=True)
                k = torch.randn(1, L, HKV, D, dtype=dtype, requires_grad=True)
                v = torch.randn(1, L, HKV, D, dtype=dtype, requires_grad=True)
                out = ring_attention(
                    q, k, v, topo.ring_group, causal=True, layout=layout, backend="cpu",
                    verify=False,
                )  # fmt: skip
                dout = torch.randn_like(out)
                tracker = MemTracker()
                tracker.track_external(q, k, v, out, dout)
                with tracker:
                    out.backward(dout)
                return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        finally:
            topo.destroy()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_p2p_backward_holds_only_what_its_contract_says(dtype, layout, monkeypatch):
    # the planning kernels size the CPU kernel's workspace for every CPU: one here, so the
    # bound (and how much of the peak it leaves to the ring's own buffers) is the same on
    # every machine
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    item, acc = dtype.itemsize, accumulation_dtype(dtype).itemsize
    q_bytes, kv_bytes = L * H * D, L * HKV * D  # elements of q (and out, dout), of k (and v)
    inputs = (3 * q_bytes + 2 * kv_bytes) * item  # q, out, dout; k, v
    accumulators = (q_bytes + 2 * kv_bytes + 2 * 2 * kv_bytes) * acc  # dq, own, travelling x2
    kv_blocks = 2 * 2 * kv_bytes * item  # the K/V block computed on and the one arriving
    kernel_outputs = (q_bytes + 2 * kv_bytes) * item  # one call's dq, dk, dv at most
    lse_slices = 2 * H * L * 4
    # while a kernel call runs, its own working memory: the planning kernels allocate the
    # CPU kernel's per-thread buffers (usp.planner.overheads), one call's at a time (a
    # call's block is at most L x L)
    workspace = attention_workspace(
        "cpu", batch=1, seqlen_q=L, seqlen_k=L, heads=H, kv_heads=HKV, head_dim=D,
        item_bytes=item, backward=True, threads=1,
    )  # fmt: skip
    bound = inputs + accumulators + kv_blocks + kernel_outputs + lse_slices + workspace
    peak = backward_peak(dtype, layout)
    assert inputs + accumulators + kv_blocks <= peak <= bound, (peak, bound)


def test_one_whole_document_is_one_dense_call_without_copies():
    """A packed call whose only document holds every row (the planner's batch, a ring
    step of one long document) returns the dense kernel's results as they are: equal to
    the dense call bit for bit, and the gradients not copies into fresh buffers."""
    from usp.kernels.backends import registry
    from usp.kernels.dispatch import dense_backward, dense_forward, docs_backward, docs_forward
    from usp.kernels.docs import PackedDocs
    from usp.kernels.spec import AttentionSpec

    torch.manual_seed(0)
    n = 64
    q, dout = torch.randn(n, H, D), torch.randn(n, H, D)
    k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    impl = registry.get("math")
    spec = AttentionSpec(1, n, n, H, HKV, D, torch.float32, q.device, True, None)
    docs = PackedDocs.build([0, n], [0, n], q.device)
    out, lse = docs_forward(impl, q, k, v, docs, spec, 0.25)
    want_out, want_lse = dense_forward(impl, q[None], k[None], v[None], spec, 0.25)
    assert torch.equal(out, want_out[0]) and torch.equal(lse, want_lse[0])
    made = []
    kernel = impl.backward

    def recorded(*args):
        made.extend(kernel(*args))
        return tuple(made[-3:])

    impl.backward = recorded  # (an instance attribute, removed below)
    try:
        grads = docs_backward(impl, dout, q, k, v, out, lse, docs, spec, 0.25)
    finally:
        del impl.backward
    assert len(made) == 3  # one kernel call, whose tensors come back themselves
    assert all(g.data_ptr() == m.data_ptr() for g, m in zip(grads, made))
    want = dense_backward(impl, dout[None], q[None], k[None], v[None], out[None], lse[None],
                          spec, 0.25)  # fmt: skip
    assert all(torch.equal(g, w[0]) for g, w in zip(grads, want))

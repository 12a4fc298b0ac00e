"""``torch.compile(fullgraph=True)`` of USP attention under sequence parallelism, on 4
gloo ranks: ulysses 2 x ring 2, 1 x 4 and 4 x 1; dense and packed; causal; p2p and
all-gather (a ring of one has no ring implementation to choose). Forward and backward
equal eager (float32, 1e-5 relative), with no break: one graph for every packing of
the p2p ring (the all-gather ring's packed call in a graph of its own, made per packing),
and the graphs hold what the eager loops do: every collective, each ring shift in
flight while a kernel runs, and the backward circulating K/V again (nothing of other
ranks saved from the forward).

The graphs are captured by Dynamo and partitioned by AOT autograd as Inductor's are
(the min-cut partitioner), then run without code generation (Inductor takes minutes on
two busy cores; ``tests/train/test_train_compile.py`` runs it). The per-call checks ran
while tracing: the ranks agreed there (verify is on for gloo), once per call shape.
"""

from __future__ import annotations

import pytest
import torch
from reference import relative_error
from usp_cases import topology

import usp

GRIDS = [(2, 2), (1, 4), (4, 1)]
LOCAL, HEADS, KV_HEADS, DIM = 8, 8, 4, 8
TOL = 1e-5
COLLECTIVE = "_c10d_functional"


def _recording_backend(graphs: list):
    """AOT autograd with the min-cut partitioner (Inductor's), graphs run as they are."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(
        fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition
    )


def _ops(gm) -> list[tuple[str, str]]:
    """(kind, node) of the collectives, waits (node: what they wait for) and kernel ops
    of a graph, in order; a ring shift is an all-to-all whose splits name one rank."""
    ops = []
    for node in gm.graph.nodes:
        target = str(node.target)
        if target.endswith("all_to_all_single.default"):
            ops.append(("shift" if 0 in node.args[1] else "all_to_all", node.name))
        elif target.endswith("wait_tensor.default"):
            ops.append(("wait_tensor", node.args[0].name))
        elif COLLECTIVE in target or target.startswith("usp."):
            ops.append((target.split(".")[-2], node.name))
    return ops


def _overlapped_shifts(ops) -> int:
    """How many shifts have a kernel running between their post and their wait."""
    kinds = [kind for kind, _ in ops]
    count = 0
    for i, (kind, name) in enumerate(ops):
        if kind == "shift":
            wait = ops.index(("wait_tensor", name), i)
            count += any(k.startswith(("dense_", "docs_")) for k in kinds[i:wait])
    return count


#: the packings of the grid's packed calls: global document boundaries in units of the
#: document multiple (2 r u tokens: every document splits over the zigzag ring and
#: Ulysses), 16 units in all; 2, 3 and 6 documents, the second with one document of a
#: single multiple (one token per rank's zigzag chunk)
PACKINGS = [(0, 12, 16), (0, 8, 9, 16), (0, 4, 6, 8, 10, 12, 16)]
#: the all-gather ring's graph is made again per packing: the first two show that a
#: second packing traces and equals eager (a third would be one more trace of the same)
ALLGATHER_PACKINGS = 2


def run_compiled_grid(ulysses: int, ring: int):
    """Two compiled functions on one grid, each against eager, with the graphs Dynamo
    made. The first, called with three packings (2, 3 and 6 documents): a dense sequence
    (batch 2) through every ring implementation (the same q/k/v) and packed documents
    (batch 1) through the p2p ring, with a non-default softmax scale and two KV-head
    chunks where there are two KV heads a rank (both reach the compiled kernels); its
    graph takes the documents as tensors, so one graph serves every packing. The second
    (ring > 1): the all-gather ring packed, whose graph indexes by document and is made
    again per packing (two packings)."""
    from torch._dynamo.utils import counters

    topo = topology(ulysses, ring)
    impls = ("p2p", "allgather") if ring > 1 else ("p2p",)
    plans = {impl: usp.Plan(topo, ring_impl=impl, backend="cpu") for impl in impls}
    options = {"softmax_scale": 0.3, "head_chunks": 2} if KV_HEADS // ulysses > 1 else {}
    multiple = 2 * ring * ulysses
    gen = torch.Generator().manual_seed(7 + topo.ulysses_rank + 10 * topo.ring_rank)

    def tensors(batch, local):
        shapes = [(batch, local, HEADS, DIM)] + [(batch, local, KV_HEADS, DIM)] * 2
        return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]

    def attend_all(q, k, v, qp, kp, vp, packed):
        outs = [plan.attention(q, k, v, causal=True) for plan in plans.values()]
        return outs + [plans["p2p"].attention(qp, kp, vp, causal=True, packed=packed, **options)]

    def attend_gathered(q, k, v, packed):
        return [plans["allgather"].attention(q, k, v, causal=True, packed=packed)]

    dense = tensors(2, LOCAL)
    calls = [(attend_all, dense, plans["p2p"], PACKINGS)]  # the plan packs the documents
    if ring > 1:
        calls.append((attend_gathered, [], plans["allgather"], PACKINGS[:ALLGATHER_PACKINGS]))
    results = []
    for fn, fixed, plan, packings in calls:
        torch._dynamo.reset()
        counters.clear()
        graphs: list = []
        compiled = torch.compile(fn, fullgraph=True, backend=_recording_backend(graphs))
        errors = []
        for units in packings:
            packed = plan.pack(torch.tensor([u * multiple for u in units], dtype=torch.int32))
            inputs = fixed + tensors(1, 4 * LOCAL)
            douts = [torch.randn(o.shape, generator=gen) for o in fn(*inputs, packed)]

            def outputs_and_grads(f, inputs=inputs, packed=packed, douts=douts):
                outs = f(*inputs, packed)
                grads = torch.autograd.grad(outs, inputs, douts)
                return [o.detach() for o in outs] + list(grads)

            got, want = outputs_and_grads(compiled), outputs_and_grads(fn)
            errors += [relative_error(g, w) for g, w in zip(got, want)]
        breaks = sum(counters["graph_break"].values())
        unique = counters["stats"]["unique_graphs"]
        forward, backward = (_ops(gm) for gm in graphs[:2])
        results.append((errors, breaks, unique, len(graphs) // 2, forward, backward))
    torch._dynamo.reset()
    return results


def _check_graphs(forward, backward, ulysses, ring, calls, sets, p2p_passes, gathers):
    """The collectives of one compiled forward/backward pair: ``calls`` attention calls
    on ``sets`` q/k/v sets, ``p2p_passes`` passes of the p2p ring (one per call and
    KV-head chunk), ``gathers`` all-gather ring calls."""
    fw, bw = ([kind for kind, _ in ops] for ops in (forward, backward))
    # Ulysses: the output back per call, q/k/v there once per input set (the ring
    # implementations attending to the same q/k/v: one all-to-all); backward: the two
    # inverses of every call
    if ulysses > 1:
        assert fw.count("all_to_all") == calls + sets, fw
        assert bw.count("all_to_all") == 2 * calls, bw
    shifts = p2p_passes * (ring - 1)  # one K/V shift per step but the last
    assert fw.count("shift") == shifts and fw.count("all_gather_into_tensor") == gathers, fw
    # backward: K/V circulate again (not saved from the forward) and dK/dV travel; the
    # all-gather ring gathers K/V again and reduce-scatters dK/dV
    assert bw.count("shift") == 2 * shifts, bw
    assert bw.count("all_gather_into_tensor") == bw.count("reduce_scatter_tensor") == gathers
    for kinds in (fw, bw):
        posted = [k for k in kinds if k in ("all_to_all", "shift")]
        posted += [k for k in kinds if k.endswith(("_into_tensor", "scatter_tensor"))]
        assert kinds.count("wait_tensor") == len(posted)
    # every shift is in flight while a kernel runs, but the last dK/dV shift of each
    # backward pass (the accumulators reaching their owners: nothing left to compute)
    assert _overlapped_shifts(forward) == shifts, fw
    assert _overlapped_shifts(backward) == 2 * shifts - (p2p_passes if ring > 1 else 0), bw


@pytest.mark.parametrize("ulysses,ring", GRIDS, ids=[f"u{u}xr{r}" for u, r in GRIDS])
def test_compiled_sp_attention_equals_eager_in_one_graph(distributed, ulysses, ring):
    """One graph (forward and backward) for every packing of the p2p ring, equal to
    eager; the all-gather ring's packed graph made again per packing (a recompile that
    works: a second packing once failed to trace)."""
    results = distributed.run(run_compiled_grid, ulysses, ring, world_size=4, timeout=900)
    chunks = 2 if KV_HEADS // ulysses > 1 else 1
    for by_fn in results:
        errors, breaks, unique, pairs, forward, backward = by_fn[0]
        assert max(errors) <= TOL, errors
        assert breaks == 0 and unique == pairs == 1, (breaks, unique, pairs)
        calls = 3 if ring > 1 else 2  # dense per ring implementation, packed
        passes = 1 + chunks  # the p2p ring's: dense, and per KV-head chunk packed
        gathers = 1 if ring > 1 else 0
        _check_graphs(forward, backward, ulysses, ring, calls, 2, passes, gathers)
        if ring > 1:  # the all-gather ring, packed: its first packing's graphs
            errors, breaks, unique, pairs, forward, backward = by_fn[1]
            assert max(errors) <= TOL, errors
            assert breaks == 0 and unique == pairs == ALLGATHER_PACKINGS, (breaks, unique, pairs)
            _check_graphs(forward, backward, ulysses, ring, 1, 1, 0, 1)


class _Node:
    """A stand-in for an Inductor scheduler node: its buffer, its graph position (the
    last member's, for a fused node), the buffers it waits for."""

    def __init__(self, name: str, order: int, deps=(), collective: bool = False):
        self.name, self.max_order, self.collective = name, order, collective
        self.unmet_dependencies = [type("Dep", (), {"name": d})() for d in deps]

    def get_buffer_names(self):
        return {self.name}


def test_the_overlap_pass_puts_each_kernel_between_its_shift_and_the_wait(monkeypatch):
    """``usp.comm.overlap.overlap_communication`` on the order Inductor gave a ring
    forward (every shift posted and waited before the first kernel): the written order
    comes back, each collective started as soon as its input exists."""
    import torch._inductor.comms as comms

    from usp.comm.overlap import overlap_communication

    monkeypatch.setattr(comms, "contains_collective", lambda snode: snode.collective)
    nodes = {
        n.name: n
        for n in [
            _Node("stack", 0),
            _Node("post0", 1, ["stack"], collective=True),
            _Node("kernel0", 2, ["stack"]),
            _Node("wait0", 3, ["post0"]),
            _Node("post1", 4, ["wait0"], collective=True),
            _Node("kernel1", 5, ["wait0"]),
            _Node("wait1", 6, ["post1"]),
            _Node("kernel2", 8, ["wait1"]),
            _Node("merges", 9, ["kernel0", "kernel1", "kernel2"]),  # fused, first member at 2
        ]
    }
    inductor = ["stack", "post0", "wait0", "post1", "wait1", "kernel0", "kernel1", "kernel2"]
    scheduled = overlap_communication([nodes[n] for n in [*inductor, "merges"]])
    assert [n.name for n in scheduled] == [
        "stack", "post0", "kernel0", "wait0", "post1", "kernel1", "wait1", "kernel2", "merges",
    ]  # fmt: skip


def run_front_doors_compiled():
    """``usp_attention(..., topology)`` makes its plan inside the trace; ``UspAttention``
    holds one: both compile whole and equal eager. Also the shifts of each graph, under
    the min-cut partitioner: under ``contiguous`` rank 0 never reads the block it
    receives (the last rank's keys are after all its queries), and so once lost that
    K/V shift from its graph alone (dead code) and posted its first dK/dV shift (zeros)
    in the forward instead, each of which left rank 1 waiting."""
    topo = topology(1, 2)
    gen = torch.Generator().manual_seed(3 + topo.ring_rank)
    q = torch.randn(1, LOCAL, HEADS, DIM, generator=gen).requires_grad_()
    k, v = (torch.randn(1, LOCAL, KV_HEADS, DIM, generator=gen).requires_grad_() for _ in "kv")
    module = usp.UspAttention(topo, causal=True, backend="cpu", layout="contiguous")
    calls = [lambda q, k, v: usp.usp_attention(q, k, v, topo, causal=True, backend="cpu"), module]
    errors, shifts = [], []
    for call in calls:
        torch._dynamo.reset()
        graphs: list = []
        compiled = torch.compile(call, fullgraph=True, backend=_recording_backend(graphs))
        got, want = compiled(q, k, v), call(q, k, v)
        grads = [torch.autograd.grad(o.sum(), (q, k, v)) for o in (got, want)]
        errors.append(max(relative_error(a, b)
                          for a, b in zip((got, *grads[0]), (want, *grads[1]))))  # fmt: skip
        shifts.append([[kind for kind, _ in _ops(gm)].count("shift") for gm in graphs])
    torch._dynamo.reset()
    return errors, shifts


def test_the_front_doors_compile(distributed):
    for errors, shifts in distributed.run(run_front_doors_compiled, world_size=2, timeout=600):
        assert max(errors) <= TOL, errors
        # forward: the K/V shift; backward: K/V again and the dK/dV accumulator; on
        # every rank, whether or not it reads what it receives
        assert shifts == [[1, 2], [1, 2]], shifts


def test_compiled_varlen_kernels_get_each_packings_longest_document(monkeypatch):
    """A varlen kernel sizes its grid by the longest document: one compiled graph hands
    each packing's own bound (a symbolic size from the PackedSequence) and boundaries to
    the kernel, not the first packing's nor the piece length. Recorded by a varlen kernel
    standing in for the CPU backend's name while the compiled calls run."""
    from usp.kernels.backends import registry
    from usp.kernels.dispatch import docs_backward, docs_forward
    from usp.kernels.docs import PackedDocs

    plan = usp.Plan(None, backend="cpu")
    seq, gen = 32, torch.Generator().manual_seed(5)
    packings = [[0, 8, 32], [0, 12, 16, 24, 32], [0, 4, 8, 12, 16, 20, 24, 28, 32]]
    packs = [plan.pack(torch.tensor(b, dtype=torch.int32)) for b in packings]
    inputs = [torch.randn(1, seq, h, DIM, generator=gen).requires_grad_() for h in (HEADS, 2, 2)]

    def attend(q, k, v, packed):
        return plan.attention(q, k, v, causal=True, packed=packed)

    def run(fn, packed):
        out = fn(*inputs, packed)
        return [out, *torch.autograd.grad(out.square().sum(), inputs)]

    expected = [run(attend, p) for p in packs]
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    run(compiled, packs[0])  # traced (with the CPU backend's per-document calls)
    cpu, real_get = registry.get("cpu"), registry.get
    seen = []

    class RecordingVarlen:
        name, supports_varlen = "cpu", True

        def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, spec, scale):
            seen.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
            docs = PackedDocs.build(cu_q.tolist(), cu_k.tolist(), q.device)
            return docs_forward(cpu, q, k, v, docs, spec, scale)

        def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale):
            seen.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
            docs = PackedDocs.build(cu_q.tolist(), cu_k.tolist(), q.device)
            return docs_backward(cpu, dout, q, k, v, out, lse, docs, spec, scale)

    monkeypatch.setattr(registry, "get", lambda n: RecordingVarlen() if n == "cpu" else real_get(n))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, want in zip(packs, expected):
            seen.clear()
            got = run(compiled, packed)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
            # the eager placement's piece boundaries (one piece of whole documents on a
            # ring of one) and the longest of them, for this packing
            piece = list(packed.placement.documents.piece_bounds)
            longest = max(y - x for x, y in zip(piece, piece[1:]))
            assert seen and all(s == (piece, piece, longest, longest) for s in seen), seen
    torch._dynamo.reset()

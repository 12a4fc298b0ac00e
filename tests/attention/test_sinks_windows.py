"""Attention sinks (and sliding windows) through USP attention on 4 gloo ranks, against
a single-process float64 reference with the sinks as an extra softmax column (as
transformers' gpt-oss) and the window as a mask: out, dq, dk, dv and dsinks (summed over
the SP group), every ring implementation and layout, dense and packed. One pooled call
per grid runs every case (u2r2's compiled packed window runs on its ring, u1r2, on 2
ranks). Tolerances: float64 1e-10; bfloat16 2e-2 (out) and 5e-2 (grads).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.distributed as dist
from reference import reference_mask, relative_error
from usp_cases import topology
from window_cases import case_inputs, usp_case

import usp
from usp.planner.traffic import document_reach_rows, traffic_formula, window_gather_rows
from usp.ring.document_reach import document_reach
from usp.ring.documents import Documents
from usp.ring.masked_window import window_mask
from usp.ring.packed_tails import packed_tail_plan
from usp.ring.placement import plan_window_gather
from usp.ring.window import chunk_pair, dense_window_blocks, ring_steps
from usp.ring.zigzag_tails import zigzag_tail_plans

TOL = {torch.float64: (1e-10, 1e-10), torch.bfloat16: (2e-2, 5e-2)}
#: dsinks in a lower-precision dtype than the inputs (rounded once, at the end)
DSINKS_TOL = {torch.float32: 1e-6, torch.bfloat16: 5e-2}
DOCS = [0, 16, 24, 64]  # 3 documents, each a multiple of 8 tokens (zigzag on r=2, u=2)
#: 2 documents of unequal lengths whose zigzag chunks (6, 10 on r=2; 3, 5 on r=4) are
#: longer than a short window's W-1: the documents' tails (usp.ring.packed_tails)
TAIL_DOCS = [0, 24, 64]


def run_sinks(ulysses, ring):
    topo = topology(ulysses, ring)
    inputs = case_inputs(64, 4, 2, seed=1)
    results = []
    for layout, ring_impl, packed in itertools.product(
        ("zigzag", "contiguous"), ("p2p", "allgather"), (None, DOCS)
    ):
        case = dict(layout=layout, ring_impl=ring_impl, packed=packed)
        case["sinks_dtype"] = torch.float32 if packed else torch.float64
        errors = usp_case(
            topo, inputs, window=None, with_sinks=True, dtype=torch.float64, **case
        )  # fmt: skip
        results.append((case, torch.float64, errors))
    # bfloat16 inputs with bfloat16 sinks
    case = dict(layout="zigzag", ring_impl="p2p", packed=None, sinks_dtype=torch.bfloat16)
    errors = usp_case(topo, inputs, window=None, with_sinks=True, dtype=torch.bfloat16, **case)
    results.append((case, torch.bfloat16, errors))
    return results


def _failures(results_by_rank) -> list[str]:
    failures = []
    for rank, results in enumerate(results_by_rank):
        for case, dtype, errors in results:
            out_tol, grad_tol = TOL[dtype]
            assert set(errors) >= {"out", "dq", "dk", "dv"}
            for name, err in errors.items():
                tol = out_tol if name == "out" else grad_tol
                if name == "dsinks":  # the gradient comes back in the sinks' dtype
                    tol = max(tol, DSINKS_TOL.get(case.get("sinks_dtype"), 0.0))
                if not err <= tol:
                    failures.append(f"rank {rank} {case} {dtype}: {name} {err:.3g}")
    return failures


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)], ids=["u2r2", "u1r4"])
def test_sinks_match_the_extra_softmax_column(distributed, grid):
    results = distributed.run(run_sinks, *grid, world_size=4, timeout=300)
    assert all("dsinks" in errors for _, _, errors in results[0])
    failures = _failures(results)
    assert not failures, "\n".join(failures)


#: transformers' sliding_window: 1 (only itself), shorter than a chunk, spanning chunks,
#: and longer than the sequence (= plain causal)
WINDOWS = (1, 5, 20, 100)


def run_windows(ulysses, ring):
    topo = topology(ulysses, ring)
    inputs = case_inputs(64, 4, 2, seed=2)
    results = []
    combos = itertools.product(("zigzag", "contiguous"), ("p2p", "allgather"), (None, DOCS))
    for index, (layout, ring_impl, packed) in enumerate(combos):
        for window in WINDOWS:
            case = dict(layout=layout, ring_impl=ring_impl, packed=packed, window=window)
            # sinks with a window in some cases; always at window 1, where a row sees only
            # itself and dq, dk would be zero (rounding noise) without them
            sinks = window == 1 or (index + window) % 3 == 0
            errors = usp_case(
                topo, inputs, with_sinks=sinks, dtype=torch.float64,
                sinks_dtype=torch.float64, **case,
            )  # fmt: skip
            results.append((case, torch.float64, errors))
    case = dict(layout="zigzag", ring_impl="p2p", packed=None, window=7)
    errors = usp_case(
        topo, inputs, with_sinks=True, dtype=torch.bfloat16, sinks_dtype=torch.float32, **case
    )
    results.append((case, torch.bfloat16, errors))
    # packed p2p with windows shorter than every document's chunk: each document's tail
    # (contiguous: DOCS' chunks 8, 4, 20 on u2r2, 4, 2, 10 on u1r4; zigzag: TAIL_DOCS'
    # chunks 6, 10 on u2r2, 3, 5 on u1r4, where window 6 reaches past the 3: the rows
    # each rank's windows read, from their owners, as DOCS' windows 5 and 20 above)
    tail_cases = [("contiguous", DOCS, w, w == 2) for w in (2, 4)]
    tail_cases += [("zigzag", TAIL_DOCS, w, w != 3) for w in (2, 3, 6)]
    for layout, packed, window, sinks in tail_cases:
        case = dict(layout=layout, ring_impl="p2p", packed=packed, window=window)
        errors = usp_case(
            topo, inputs, with_sinks=sinks, dtype=torch.float64, sinks_dtype=torch.float64,
            **case,
        )  # fmt: skip
        results.append((case, torch.float64, errors))
    # a value head size of its own (MLA): smaller and larger than q/k's 8; the ring sends
    # K and V at their own sizes (whole blocks, contiguous and zigzag tails, documents'
    # reach, all-gather)
    mla_cases = (
        (4, "p2p", DOCS, "contiguous", 20),
        (12, "allgather", None, "contiguous", 20),
        (12, "p2p", None, "zigzag", 5),
        (4, "p2p", None, "zigzag", None),
        (4, "allgather", DOCS, "zigzag", 5),
        (12, "p2p", TAIL_DOCS, "zigzag", 3),  # each document's tail, both ways
    )
    for value_dim, ring_impl, packed, layout, window in mla_cases:
        mla = case_inputs(64, 4, 2, seed=value_dim, value_dim=value_dim)
        case = dict(layout=layout, ring_impl=ring_impl, packed=packed, window=window)
        errors = usp_case(
            topo, mla, with_sinks=True, dtype=torch.float64, sinks_dtype=torch.float64, **case
        )
        results.append(({**case, "value_dim": value_dim}, torch.float64, errors))
    # under torch.compile(fullgraph=True), dense (u1r4): the contiguous tails and the
    # dK/dV's early return (2 steps of 4), the all-gather's window segments, and a zigzag
    # window shorter than a chunk (neighbours' tails); the last two with MLA (K and V at
    # their own head sizes in the graph's gathers and shifts)
    dense = [
        ("contiguous", "p2p", 5, True, None, 8),
        ("contiguous", "allgather", 20, True, None, 4),
    ]
    dense += [("zigzag", "p2p", 5, False, None, 12)]
    # packed documents with a window, compiled: one graph for every window and packing
    # (every step, every block masked from the device bounds, usp.ring.masked_window),
    # the window only a number in its masks, so one window reaches every kind of row:
    # window 6 over DOCS' chunks 4, 2, 10 (u1r4 contiguous here; zigzag on a ring of 2:
    # run_compiled_packed_window) is shorter than one document's chunk and spans the
    # others' (blocks 1, 2 and 3 chunks back), and leaves rows of a block with no key
    # (out 0, lse -inf). u2r2: dense MLA zigzag tails with sinks (r = 2: both messages
    # between one pair of ranks; the all-to-alls at each tensor's own head size)
    if ring == 4:
        compiled_cases = [*dense, ("contiguous", "p2p", 6, False, DOCS, 8)]
    else:
        compiled_cases = [("zigzag", "p2p", 5, True, None, 4)]
    graph_bytes = []  # dense: what the compiled graphs send, against the formula
    for layout, ring_impl, window, sinks, packed, value_dim in compiled_cases:
        case = dict(layout=layout, ring_impl=ring_impl, packed=packed, window=window)
        traffic = {}
        errors = usp_case(
            topo, case_inputs(64, 4, 2, seed=2, value_dim=value_dim), with_sinks=sinks,
            dtype=torch.float64, sinks_dtype=torch.float64, compiled=True, traffic=traffic,
            **case,
        )  # fmt: skip
        case = {**case, "compiled": True, "value_dim": value_dim}
        results.append((case, torch.float64, errors))
        if packed is None:  # (packed: every step's whole block, masked; no formula)
            want = _formula((ulysses, ring), layout, ring_impl, window, 64, value_dim, None, 8)
            sent = {
                phase: {k: c["sent"] for k, c in kinds.items()} for phase, kinds in want.items()
            }
            graph_bytes.append((case, traffic, sent))
    return results, graph_bytes


def run_compiled_packed_window():
    """The zigzag packed window under compile with sinks (window 6 over DOCS' chunks 4,
    2, 10, as u1r4's contiguous one in run_windows) on u1r2: the ring of u2r2 after its
    all-to-all (the same chunks and masks), on 2 ranks. The all-to-all of packed inputs
    under compile on 4 ranks (u2r2): test_compiled_attention.py's
    ``test_compiled_sp_attention_equals_eager_in_one_graph[u2xr2]``; sinks under
    compile with u = 2: run_windows(2, 2)'s dense zigzag case."""
    case = dict(layout="zigzag", ring_impl="p2p", packed=DOCS, window=6)
    errors = usp_case(
        topology(1, 2), case_inputs(64, 4, 2, seed=2), with_sinks=True, dtype=torch.float64,
        sinks_dtype=torch.float64, compiled=True, **case,
    )  # fmt: skip
    return [({**case, "compiled": True}, torch.float64, errors)]


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)], ids=["u2r2", "u1r4"])
def test_windows_match_the_masked_reference(distributed, grid):
    # u1r4 also compiles four calls, u2r2 one (and u2r2's ring, u1r2, the packed window
    # on 2 ranks): minutes on a loaded 2-core machine
    by_rank = distributed.run(run_windows, *grid, world_size=4, timeout=1200)
    results = [found for found, _ in by_rank]
    assert any("dsinks" in errors for _, _, errors in results[0])
    failures = _failures(results)
    if grid == (2, 2):
        on_u1r2 = distributed.run(run_compiled_packed_window, world_size=2, timeout=900)
        assert all("dsinks" in errors for found in on_u1r2 for _, _, errors in found)
        failures += [f"u1r2 {line}" for line in _failures(on_u1r2)]
    # compiled, dense: the bytes the graphs' collectives send (the counters see nothing
    # under compile) are the formula's, windowed tails and MLA's own head sizes included
    for rank, (_, graph_bytes) in enumerate(by_rank):
        assert graph_bytes, "no dense compiled case"
        for case, traffic, want in graph_bytes:
            if traffic != want:
                failures.append(f"rank {rank} {case}: graph sends {traffic} != {want}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ refusals and compile
def _message(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test compares type and text
        return f"{type(err).__name__}: {err}"
    return "no error"


def run_refusals():
    """Bad windows and sinks on rank 1 only (u1r2, verify on): every rank raises rank 1's
    error before the first collective, and the groups stay usable (a valid windowed
    call and a barrier after each; the harness's short timeout catches a hang); a value
    head size of its own on rank 1 only: the same disagreement error on both ranks."""
    rank = dist.get_rank()
    topo = topology(1, 2)
    q, k, v, dout, sinks = case_inputs(32, 4, 2, seed=3)
    local = [usp.shard_sequence(t, topo) for t in (q, k, v)]
    attend = lambda **kw: usp.usp_attention(*local, topo, **kw)  # noqa: E731
    bad = {
        "non-causal": dict(causal=rank == 0, window=4) if rank else dict(causal=True, window=4),
        "zero": dict(causal=True, window=0 if rank else 4),
        "bool": dict(causal=True, window=True if rank else 4),
        "sinks-shape": dict(causal=True, sinks=sinks[:3] if rank else sinks),
        "sinks-int": dict(causal=True, sinks=sinks.long() if rank else sinks),
    }
    messages = {}
    for name, options in bad.items():
        messages[name] = _message(lambda: attend(**options))  # noqa: B023
        out = attend(causal=True, window=4)  # still usable
        dist.barrier()
    # MLA on rank 1 only (v's head size 4 against 8): the all-to-alls and ring messages
    # are sized by it, so the ranks agree on it first
    value = local[2][..., :4] if rank else local[2]
    messages["v-head-size"] = _message(
        lambda: usp.usp_attention(local[0], local[1], value, topo, causal=True)
    )
    out = attend(causal=True, window=4)
    dist.barrier()
    plan = usp.Plan(topo, backend="cpu", ring_impl="allgather")
    # packed documents with a window under compile on the all-gather ring (its
    # per-document gathers would specialise the graph to one packing; p2p computes it)
    docs = plan.pack(torch.tensor([0, 16, 32], dtype=torch.int32))
    compiled = torch.compile(
        lambda a, b, c: plan.attention(a, b, c, causal=True, window=4, packed=docs),
        fullgraph=True, backend="eager",
    )  # fmt: skip
    messages["compile"] = _message(lambda: compiled(*local))
    torch._dynamo.reset()
    # sinks under torch.compile(fullgraph=True): the eager result
    leaves = [t.clone().requires_grad_() for t in local]
    s = sinks.clone().requires_grad_()
    compiled_sinks = torch.compile(
        lambda a, b, c, s: plan.attention(a, b, c, causal=True, sinks=s),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    got = compiled_sinks(*leaves, s)
    got.sum().backward()
    eager_leaves = [t.clone().requires_grad_() for t in local]
    s_eager = sinks.clone().requires_grad_()
    want = plan.attention(*eager_leaves, causal=True, sinks=s_eager)
    want.sum().backward()
    torch._dynamo.reset()
    pairs = [(got, want), (s.grad, s_eager.grad)] + [
        (a.grad, b.grad) for a, b in zip(leaves, eager_leaves)
    ]
    compile_error = max(relative_error(a, b) for a, b in pairs)
    # the module form: window at construction, sinks in forward; the function's result
    module = usp.UspAttention(topo, causal=True, window=4, layout="zigzag")
    assert "window=4" in repr(module)
    by_module = module(*local, sinks=sinks)
    by_function = usp.usp_attention(*local, topo, causal=True, window=4, sinks=sinks)
    compile_error = max(compile_error, relative_error(by_module, by_function))
    # one KV head at a time (Levers' attention_head_chunks), contiguous: the same result
    contiguous = usp.Plan(topo, layout="contiguous")
    local = [usp.shard_sequence(t, topo, layout="contiguous") for t in (q, k, v)]
    whole = contiguous.attention(*local, causal=True, window=6, sinks=sinks)
    chunked = contiguous.attention(*local, causal=True, window=6, sinks=sinks, head_chunks=2)
    compile_error = max(compile_error, relative_error(chunked, whole))
    return messages, out.shape, compile_error


def test_what_cannot_be_computed_is_refused_on_every_rank(distributed):
    results = distributed.run(run_refusals, world_size=2, timeout=120)
    expected = {
        "non-causal": "window=4 needs causal=True",
        "zero": "window must be None (full attention) or an int >= 1",
        "bool": "window must be None (full attention) or an int >= 1",
        "sinks-shape": "sinks must have shape [num_heads] = [4]",
        "sinks-int": "sinks must be a floating-point tensor",
        "compile": "window=4 with packed documents is not supported under torch.compile",
        "v-head-size": "RankDisagreementError: usp_attention: the ranks of the group "
        "disagree on v.shape[3] (rank 0: 8; rank 1: 4)",
    }
    for messages, shape, compile_error in results:
        assert shape == (1, 16, 4, 8)
        assert compile_error < 1e-12
        for name, part in expected.items():
            assert part in messages[name], (name, messages[name])
            if name not in ("compile", "v-head-size"):  # agreed: rank 1's error on both
                assert "failed on rank 1 of 2" in messages[name], messages[name]
    assert results[0][0] == results[1][0]


# ------------------------------------------------------------------ traffic
#: MLA under Ulysses alone (u4r1: KV heads replicated 2x): v smaller and larger than q/k
ULYSSES_MLA = (("zigzag", "p2p", None, 4, None), ("contiguous", "p2p", 16, 12, None))


def run_window_traffic():
    """CommStats of one windowed forward and backward per case (bf16, B 1, S 256, 4
    query / 2 KV heads of 8; v's head size 8, or 4 and 12 for MLA) under u1r4, u2r2 and
    (MLA only) u4r1; and, on u4r1, the float64 errors of those MLA cases."""
    results, errors = {}, []
    topo = topology(4, 1)
    for layout, ring_impl, window, value_dim, _ in ULYSSES_MLA:
        mla = case_inputs(64, 4, 2, seed=value_dim, value_dim=value_dim)
        case = dict(layout=layout, ring_impl=ring_impl, packed=None, window=window)
        found = usp_case(
            topo, mla, with_sinks=True, dtype=torch.float64, sinks_dtype=torch.float64, **case
        )
        errors.append(({**case, "value_dim": value_dim}, torch.float64, found))
    for grid in ((1, 4), (2, 2), (4, 1)):
        topo = topology(*grid)
        cases = [
            *itertools.product(("contiguous", "zigzag"), ["p2p"], (1, 16, 40, 1000)),
            # the all-gather ring gathers the rows windows reach: none (1), a chunk's
            # tail (16), more than a zigzag chunk of u2r2 (100), everything (1000)
            *itertools.product(("contiguous", "zigzag"), ["allgather"], (1, 16, 100, 1000)),
        ]
        cases = [(*case, 8, None) for case in cases] + [
            ("zigzag", "p2p", 16, 12, None),  # MLA: K and V each at its own head size
            ("contiguous", "p2p", None, 4, None),
            ("contiguous", "p2p", 40, 12, None),
            ("zigzag", "allgather", 16, 4, None),
            ("contiguous", "allgather", None, 12, None),
            # packed documents: every document's tail (4, both layouts; 16 contiguous
            # on u2r2, whose shortest chunk is 16), or the rows of earlier chunks each
            # rank's windows read, from their owners (per rank)
            *((layout, "p2p", w, 8, TRAFFIC_DOCS) for layout in ("contiguous", "zigzag")
              for w in (4, 16, 40)),
            # the all-gather ring, packed: each document's rows that windows reach
            *((layout, "allgather", w, 8, TRAFFIC_DOCS) for layout in ("contiguous", "zigzag")
              for w in (4, 16)),
        ]  # fmt: skip
        if grid == (4, 1):
            cases = ULYSSES_MLA
        for layout, ring_impl, window, value_dim, docs in cases:
            q, k, v, dout, _ = case_inputs(256, 4, 2, seed=4, value_dim=value_dim)
            cu = None if docs is None else torch.tensor(docs, dtype=torch.int32)
            shard = dict(layout=layout, cu_seqlens=cu)
            local = [
                usp.shard_sequence(t, topo, **shard).to(torch.bfloat16).requires_grad_()
                for t in (q, k, v)
            ]
            topo.comm_stats.reset()
            out = usp.usp_attention(
                *local, topo, causal=True, ring_impl=ring_impl, window=window, **shard
            )
            forward = topo.comm_stats.snapshot()
            topo.comm_stats.reset()
            out.backward(usp.shard_sequence(dout, topo, **shard).to(torch.bfloat16))
            backward = topo.comm_stats.snapshot()
            docs = None if docs is None else tuple(docs)
            results[grid, layout, ring_impl, window, value_dim, docs] = {
                "forward": forward,
                "backward": backward,
            }
    return results, errors


#: packed documents of 64, 32 and 160 tokens (chunks of 16, 8, 40 on u1r4's ring of 4;
#: 32, 16, 80 on u2r2's ring of 2; zigzag: half those)
TRAFFIC_DOCS = [0, 64, 96, 256]


def _formula(grid, layout, ring_impl, window, seqlen=256, value_dim=8, docs=None, item=2, rank=0):
    """The stated bytes of the cases here (4 query / 2 KV heads of 8; ``item``: the
    element size, 2 for bf16 with float32 accumulators, 8 for float64 with float64;
    ``rank``: the ring rank, for packed windows past a chunk)."""
    lengths = None if docs is None else tuple(b - a for a, b in zip(docs, docs[1:]))
    return traffic_formula(
        types.SimpleNamespace(heads=4, kv_heads=2, head_dim=8), batch=1, seqlen=seqlen,
        ulysses=grid[0], ring=grid[1], ring_impl=ring_impl, item_bytes=item,
        acc_bytes=max(4, item),
        window=window, layout=layout, value_dim=value_dim, doc_lengths=lengths, rank=rank,
    )  # fmt: skip


def test_a_windowed_layer_moves_the_stated_bytes(distributed):
    failures = []
    by_rank = distributed.run(run_window_traffic, world_size=4)
    # u4r1, MLA in float64: v at its own head size through the all-to-alls, exact
    assert len(by_rank[0][1]) == len(ULYSSES_MLA)
    failures += _failures([errors for _, errors in by_rank])
    for rank, (results, _) in enumerate(by_rank):
        for (grid, layout, impl, window, value_dim, docs), traffic in results.items():
            ring_rank = rank // grid[0]  # packed windows past a chunk: per ring rank
            want = _formula(
                grid, layout, impl, window, value_dim=value_dim, docs=docs, rank=ring_rank
            )
            if traffic != want:
                failures.append(
                    f"rank {rank} {grid} {layout} {impl} W={window} Dv={value_dim} {docs}: "
                    f"{traffic} != {want}"
                )
    assert not failures, "\n".join(failures[:8])
    # contiguous u1r4, 64 tokens a rank: a window of 16 needs the previous rank's last
    # 15 keys only: 15 rows against the full ring's 3 blocks of 64 (forward and backward)
    full = _formula((1, 4), "contiguous", "p2p", None)
    w16 = _formula((1, 4), "contiguous", "p2p", 16)
    for phase in ("forward", "backward"):
        assert 3 * 64 * w16[phase]["p2p"]["sent"] == 15 * full[phase]["p2p"]["sent"]
    assert "p2p" not in _formula((1, 4), "contiguous", "p2p", 1)["forward"]
    # the case: window 16 on u1r8 at 128k tokens: O(W) bytes, not O(S)
    big = dict(seqlen=131072, layout="contiguous", ring_impl="p2p")
    ratio = (
        _formula((1, 8), window=16, **big)["backward"]["p2p"]["sent"]
        / _formula((1, 8), window=None, **big)["backward"]["p2p"]["sent"]
    )
    assert ratio == pytest.approx(15 / (7 * 16384))
    # the all-gather ring, contiguous u1r4: every rank contributes its last 15 rows of
    # 64; zigzag u1r4 (chunks of 32): the last 15 of both chunks
    for layout, rows in (("contiguous", 15), ("zigzag", 30)):
        full = _formula((1, 4), layout, "allgather", None)
        w16 = _formula((1, 4), layout, "allgather", 16)
        for phase, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            assert 64 * w16[phase][kind]["sent"] == rows * full[phase][kind]["sent"]
    assert "all_gather" not in _formula((1, 4), "zigzag", "allgather", 1)["forward"]
    # zigzag p2p u1r4 (chunks of 32): window 16 sends its two neighbours 15 rows each
    # (and their dK/dV back) against the full ring's 3 blocks of 64 (and 3 accumulators)
    full = _formula((1, 4), "zigzag", "p2p", None)
    w16 = _formula((1, 4), "zigzag", "p2p", 16)
    for phase, calls in (("forward", 2), ("backward", 4)):
        assert 3 * 64 * w16[phase]["p2p"]["sent"] == 2 * 15 * full[phase]["p2p"]["sent"]
        assert w16[phase]["p2p"]["calls"] == calls
    assert _formula((1, 4), "zigzag", "p2p", 40) == full  # 39 keys: more than a chunk
    # MLA, u2r2: the ring moves K (8) and V (4) columns, 12 of the padded pair's 16; the
    # all-to-alls q (4 heads) and k (2) of 8 columns, v (2) and out (4) of 4: 72 of 96
    mla, same = (_formula((2, 2), "contiguous", "p2p", None, value_dim=d) for d in (4, 8))
    for phase in ("forward", "backward"):
        assert 16 * mla[phase]["p2p"]["sent"] == 12 * same[phase]["p2p"]["sent"]
        assert 96 * mla[phase]["all_to_all"]["sent"] == 72 * same[phase]["all_to_all"]["sent"]
    # packed, contiguous u1r4: window 4 sends the last 3 rows of each of the 3 documents
    # against the 64 rows of a whole block; window 16 reaches past the 8-row chunk: rank
    # 3 receives the last 15 rows of chunk 2 of each document (15 + 8 + 15) and the last
    # 7 of the short document's chunk 1, 45 rows in 2 messages, against 3 blocks of 64
    packed = {w: _formula((1, 4), "contiguous", "p2p", w, docs=TRAFFIC_DOCS) for w in (4, 16)}
    whole = _formula((1, 4), "contiguous", "p2p", None)
    assert 64 * packed[4]["forward"]["p2p"]["sent"] == 9 * whole["forward"]["p2p"]["sent"] // 3
    last = _formula((1, 4), "contiguous", "p2p", 16, docs=TRAFFIC_DOCS, rank=3)["forward"]
    assert 64 * last["p2p"]["received"] == 45 * whole["forward"]["p2p"]["received"] // 3
    assert last["p2p"]["sent"] == 0 and last["p2p"]["calls"] == 2
    # the all-gather ring, packed, u1r4 window 16 (15 keys): every rank contributes of each
    # document (chunks 16, 8, 40 contiguous; 8, 4, 20 zigzag) its chunks' last 15 rows
    # (zigzag: of both chunks): 15 + 8 + 15 = 38 and 16 + 8 + 30 = 54 rows of 64
    for layout, rows in (("contiguous", 38), ("zigzag", 54)):
        full = _formula((1, 4), layout, "allgather", None)
        w16 = _formula((1, 4), layout, "allgather", 16, docs=TRAFFIC_DOCS)
        for phase, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            assert 64 * w16[phase][kind]["sent"] == rows * full[phase][kind]["sent"]
    # packed, zigzag u1r4 (chunks 8, 4, 20): window 4 sends the last 3 rows of each
    # document of each piece, one message each way (18 rows against 3 blocks of 64)
    zigzag = _formula((1, 4), "zigzag", "p2p", 4, docs=TRAFFIC_DOCS)
    for phase, calls in (("forward", 2), ("backward", 4)):
        sent = zigzag[phase]["p2p"]["sent"]
        assert 3 * 64 * sent == 18 * _formula((1, 4), "zigzag", "p2p", None)[phase]["p2p"]["sent"]
        assert zigzag[phase]["p2p"]["calls"] == calls


def test_a_window_of_16_at_u1r8_moves_a_small_fraction_of_the_full_rings_bytes():
    """One rank (3) of a u1xr8 job under the ``fake`` process group, 64 tokens a rank,
    contiguous p2p: the counted bytes of a window-16 layer (forward and backward) equal
    the formula and are 15 rows' worth (the previous rank's last 15 keys) against the
    full ring's 7 blocks of 64."""
    from usp.process_groups.fake import fake_world

    q, k, v, dout, _ = case_inputs(512, 4, 2, seed=5)
    measured = {}
    with fake_world(8, 3, torch.device("cpu")):
        topo = usp.build_topology(1, 8)
        try:
            for window in (16, None):
                local = [
                    usp.shard_sequence(t, topo, layout="contiguous").to(torch.bfloat16)
                    for t in (q, k, v, dout)
                ]
                inputs = [t.requires_grad_() for t in local[:3]]
                topo.comm_stats.reset()
                out = usp.usp_attention(
                    *inputs, topo, causal=True, layout="contiguous", window=window
                )
                forward = topo.comm_stats.snapshot()
                topo.comm_stats.reset()
                torch.autograd.grad(out, inputs, local[3])
                measured[window] = {"forward": forward, "backward": topo.comm_stats.snapshot()}
        finally:
            topo.destroy()
    for window, traffic in measured.items():
        assert traffic == _formula((1, 8), "contiguous", "p2p", window, seqlen=512), window
    for phase in ("forward", "backward"):
        sent = {w: measured[w][phase]["p2p"]["sent"] for w in measured}
        assert sent[16] * 7 * 64 == sent[None] * 15, (phase, sent)
        assert sent[16] < sent[None] / 25, (phase, sent)


# ------------------------------------------------------------------ geometry (one process)
def window_gather(documents, rank, w):
    return plan_window_gather(documents, rank, len(documents.lengths) > 1, torch.device("cpu"), w)


def test_chunk_pairs_keep_exactly_the_window():
    """chunk_pair's rows, keys and kernel window (spec.py's masking semantics) select the
    same query-key pairs as the window itself, for every distance, chunk and window; and
    None exactly when no pair is visible."""
    for n, delta, w in itertools.product((1, 3, 4, 7), range(-1, 5), range(0, 30)):
        q_pos = torch.arange(n)[:, None] + delta * n  # query positions, keys at 0 .. n-1
        k_pos = torch.arange(n)[None, :]
        want = (k_pos <= q_pos) & (k_pos >= q_pos - w)
        got = torch.zeros(n, n, dtype=torch.bool)
        pair = chunk_pair(delta, n, w)
        if pair is not None:
            rows, keys, causal, window = pair
            sq, sk = rows.stop - rows.start, keys.stop - keys.start
            got[rows, keys] = reference_mask(sq, sk, causal, window)
        assert torch.equal(got, want), (n, delta, w, pair)
        assert (pair is None) == (not want.any()), (n, delta, w)


def test_a_window_skips_blocks_steps_and_gathered_keys():
    # contiguous r4, 64 tokens a rank: window 16 (w 15) needs the previous rank only
    assert ring_steps("contiguous", 4, 64, None, 15) == 2
    assert dense_window_blocks("contiguous", 4, 3, 1, 64, 15) == []  # two ranks back
    assert ring_steps("zigzag", 4, 64, None, 15) == 4
    assert ring_steps("zigzag", 4, 64, None, 0) == 1  # window 1: a query sees itself
    # all-gather, zigzag r2, 64 tokens: rank 0's second piece (chunk 3) with window 5 (w 4)
    # takes chunks 2 and 3 (positions 32 .. 63), not all four
    documents = Documents.single(64, 2, "zigzag")
    rows, bounds = documents.window_rows(0, 1, 4)
    positions = torch.cat([documents.block_positions(r) for r in range(2)])
    # takes keys 44 .. 63 (chunk 3 is 48 .. 63, its first query sees 4 keys before)
    assert positions[rows].tolist() == list(range(44, 64)) and bounds == [0, 20]
    full, _ = documents.visible_rows(0, 1, True)
    assert full.numel() == 64


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_windowed_all_gather_takes_exactly_the_keys_windows_reach(layout):
    """For every ring size, block and window (and packed documents): every query piece's
    keys are its documents' positions from its first query's window start to its last
    query, each read from the owner's contributed rows (or its own block); a rank
    contributes the most rows any block has that other ranks read, which is the closed
    form the traffic formula states (packed: summed over the documents' blocks)."""
    cases = [((s,), r, w) for r in (2, 3, 4) for s in (8 * r, 16 * r) for w in (0, 1, 3, 7, 9, 40)]
    cases += [((8, 24, 16), 2, 3), ((16, 8, 8, 32), 4, 5), ((32, 16), 4, 0)]
    cases += [((8, 24, 16), 2, 9), ((16, 8, 8, 32), 4, 1), ((12, 24, 6), 3, 4)]
    cases += [((12, 24, 6), 3, 13), ((48, 16), 4, 30)]
    for lengths, r, w in cases:
        documents = Documents(lengths, r, layout)
        local_len = documents.local_len
        starts = [sum(lengths[:d]) for d in range(len(lengths))]
        positions = torch.cat([documents.block_positions(rank) for rank in range(r)])
        gathers = [window_gather(documents, rank, w) for rank in range(r)]
        m = gathers[0].rows_per_rank
        sent = [positions[rank * local_len + g.send_rows] for rank, g in enumerate(gathers)]
        for rank, gather in enumerate(gathers):
            assert gather.rows_per_rank == m and gather.send_rows.numel() == m
            # the buffer a rank attends over: every rank's m rows, then its own block
            buffer = torch.cat([*sent, documents.block_positions(rank)])
            for piece, segment in enumerate(gather.segments):
                chunk = documents.chunk_of(rank, piece)
                want = []
                for start, length in zip(starts, lengths):
                    n = length // documents.chunks_per_doc
                    want += range(start + max(0, chunk * n - w), start + (chunk + 1) * n)
                assert buffer[segment.kv_rows].tolist() == want, (lengths, r, w, rank, piece)
        # packed: each document's block (length / r) contributes as a dense one
        want_m = sum(window_gather_rows(layout, r, n // r, w) for n in lengths)
        assert m == want_m, (lengths, r, w)


def test_zigzag_tails_hold_every_pair_a_short_window_reads():
    """A zigzag window shorter than a chunk: each rank's blocks against its own K/V and
    its neighbours' tails compute exactly the query-key pairs of the whole windowed ring
    (every rank's blocks against every rank's K/V), for every ring size, block and
    window; the tails are W-1 rows."""

    def pairs(block, q_len, k_len):
        rows, keys = range(q_len)[block.q_rows], range(k_len)[block.kv_rows]
        return int(reference_mask(len(rows), len(keys), block.causal, block.window).sum())

    for r, local_len in itertools.product((2, 3, 4, 5), (4, 8, 16)):
        for w in range(1, local_len // 2):
            plans = zigzag_tail_plans(r, local_len, w)
            assert plans is not None, (r, local_len, w)
            for rank, plan in enumerate(plans):
                prev, nxt = plan.messages
                assert prev.rows == nxt.rows == w and (prev.hops, nxt.hops) == (1, -1)
                got = sum(pairs(b, local_len, local_len) for b in plan.own)
                got += sum(pairs(b, local_len, w) for b in (*prev.blocks, *nxt.blocks))
                want = sum(
                    pairs(b, local_len, local_len)
                    for kv_rank in range(r)
                    for b in dense_window_blocks("zigzag", r, rank, kv_rank, local_len, w)
                )
                assert got == want > 0, (r, local_len, w, rank)
                assert bool(prev.blocks) == (rank > 0), (r, local_len, w, rank)
                assert bool(nxt.blocks) == (rank < r - 1), (r, local_len, w, rank)


def _pairs(q_pos, k_pos, causal, window) -> torch.Tensor:
    """The (query, key) global positions a call of these rows and keys computes, as
    query * 4096 + key."""
    q_index, k_index = reference_mask(len(q_pos), len(k_pos), causal, window).nonzero().T
    return q_pos[q_index] * 4096 + k_pos[k_index]


def _own_pairs(documents, mine, block, w) -> list[torch.Tensor]:
    """A packed own block between whole pieces, per document: the diagonal's causal
    window (delta 0) or :func:`chunk_pair` between two pieces."""
    bounds, piece_len = documents.piece_bounds, documents.piece_len
    q_piece, kv_piece = block.q_rows.start, block.kv_rows.start  # piece offsets
    assert {q_piece, kv_piece} <= {0, piece_len}
    found = []
    for start, stop in zip(bounds, bounds[1:]):
        n = stop - start
        diagonal = (slice(0, n), slice(0, n), True, w)
        pair = diagonal if block.causal else chunk_pair(block.delta, n, w)
        if pair is not None:
            rows, keys, causal, window = pair
            q_pos, k_pos = mine[q_piece + start :][rows], mine[kv_piece + start :][keys]
            found.append(_pairs(q_pos, k_pos, causal, window))
    return found


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_packed_tails_hold_every_pair_a_short_window_reads(layout):
    """Packed documents, a window shorter than every document's chunk: each rank's own
    blocks and its calls against the document tails its neighbours send (those ranks'
    rows, at the ring positions the message comes from) compute every query-key pair
    of the windowed documents exactly once, for several ring sizes and packings; every
    message is w rows of each document, the same on every rank."""
    for lengths, r in (((16, 24, 8), 2), ((24, 40, 32, 16), 2), ((12, 6, 18), 3), ((32, 24), 4)):
        documents = Documents(lengths, r, layout)
        bounds = tuple(documents.piece_bounds)
        positions = [documents.block_positions(rank) for rank in range(r)]
        starts = torch.tensor([sum(lengths[:d]) for d in range(len(lengths))])
        for w in range(1, min(b - a for a, b in zip(bounds, bounds[1:]))):
            plans = [packed_tail_plan(layout, r, rank, bounds, w) for rank in range(r)]
            assert len(plans[0].messages) == (2 if layout == "zigzag" else 1)
            for rank, plan in enumerate(plans):
                mine = positions[rank]
                got = [p for block in plan.own for p in _own_pairs(documents, mine, block, w)]
                for index, message in enumerate(plan.messages):
                    assert message.rows == len(lengths) * w
                    sender = (rank - message.hops) % r
                    sent = plans[sender].messages[index].ranges
                    k_pos = positions[sender][torch.cat([torch.arange(a, b) for a, b in sent])]
                    for b in message.blocks:
                        got.append(_pairs(mine[b.q_rows], k_pos[b.kv_rows], b.causal, b.window))
                # every query's keys: its document's, from q - w to q
                document_start = starts[torch.bucketize(mine, starts, right=True) - 1]
                first = torch.maximum(document_start, mine - w).tolist()
                want = torch.cat(
                    [q * 4096 + torch.arange(a, q + 1) for q, a in zip(mine.tolist(), first)]
                )
                got = torch.cat(got).sort().values
                assert torch.equal(got, want.sort().values), (layout, lengths, r, w, rank)


def test_the_compiled_window_mask_keeps_what_the_eager_per_document_calls_read():
    """usp.ring.masked_window's mask (from device bounds) equals the rows and keys of
    the eager per-document calls (chunk_pair, the kernels' bottom-right alignment) for
    every delta and window over a piece of chunks 4, 2, 10."""
    bounds = [0, 4, 6, 16]
    cu = torch.tensor(bounds, dtype=torch.int32)
    for delta, w in itertools.product(range(4), (0, 1, 2, 5, 23)):
        expected = torch.zeros(16, 16, dtype=torch.bool)
        for start, stop in zip(bounds, bounds[1:]):
            pair = chunk_pair(delta, stop - start, w)
            if pair is None:
                continue
            rows, keys, causal, window = pair
            shift = (keys.stop - keys.start) - (rows.stop - rows.start)  # bottom-right
            for i, j in itertools.product(
                range(rows.start, rows.stop), range(keys.start, keys.stop)
            ):
                diagonal = i + shift  # the key of row i's own position, chunk-relative
                seen = (not causal or j - keys.start <= diagonal) and (
                    window is None or j - keys.start >= diagonal - window
                )
                expected[start + i, start + j] = seen
        assert torch.equal(window_mask(cu, 16, delta, w), expected), (delta, w)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_document_reach_holds_every_pair_a_long_window_reads(layout):
    """Packed documents whose window reaches past some document's chunk: each rank's own
    blocks and its calls against the messages it receives (matched in posting order with
    the sender's messages to it, read at the sender's rows) compute every query-key
    pair of the windowed documents exactly once; the rows each rank receives are those
    the formula states (``traffic_formula(..., rank=)``)."""
    for lengths, r in (((16, 24, 8), 2), ((12, 6, 18), 3), ((32, 8, 24), 4)):
        documents = Documents(lengths, r, layout)
        bounds = tuple(documents.piece_bounds)
        positions = [documents.block_positions(rank) for rank in range(r)]
        starts = torch.tensor([sum(lengths[:d]) for d in range(len(lengths))])
        for w in range(1, max(lengths)):
            plans = [document_reach(layout, r, rank, bounds, w) for rank in range(r)]
            for rank, plan in enumerate(plans):
                mine = positions[rank]
                got = [p for block in plan.own for p in _own_pairs(documents, mine, block, w)]
                taken = {}  # per sender: how many of its messages to this rank are matched
                for receive in plan.receives:
                    sender = receive.peer
                    to_me = [s for s in plans[sender].sends if s.peer == rank]
                    send = to_me[taken.get(sender, 0)]
                    taken[sender] = taken.get(sender, 0) + 1
                    rows = torch.cat([torch.arange(a, b) for a, b in send.ranges])
                    assert len(rows) == receive.rows
                    k_pos = positions[sender][rows]
                    for b in receive.blocks:
                        got.append(_pairs(mine[b.q_rows], k_pos[b.kv_rows], b.causal, b.window))
                assert all(
                    taken.get(s, 0) == sum(m.peer == rank for m in plans[s].sends) for s in range(r)
                ), (layout, lengths, r, w, rank)
                sent = sum(b - a for m in plan.sends for a, b in m.ranges)
                received = sum(m.rows for m in plan.receives)
                counts = ((sent, len(plan.sends)), (received, len(plan.receives)))
                chunks = tuple(b - a for a, b in zip(bounds, bounds[1:]))
                assert document_reach_rows(layout, r, rank, chunks, w) == counts
                document_start = starts[torch.bucketize(mine, starts, right=True) - 1]
                first = torch.maximum(document_start, mine - w).tolist()
                want = torch.cat(
                    [q * 4096 + torch.arange(a, q + 1) for q, a in zip(mine.tolist(), first)]
                )
                got = torch.cat(got).sort().values
                assert torch.equal(got, want.sort().values), (layout, lengths, r, w, rank)

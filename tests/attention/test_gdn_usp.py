"""Gated DeltaNet under hybrid SP (issue 45): the kernel against the recurrence and
transformers, and ``usp.linear.gated_deltanet_usp`` on 4 gloo ranks (u1r4, u2r2, u4r1;
zigzag and contiguous; dense and packed) against a one-process float64 reference,
forward and every gradient (inputs and conv weights); the traffic against docs/models.md's
formula; refusals on every rank before the first collective.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from fla_standin import standin_conv_kernel, standin_kernel
from gdn_cases import gdn_inputs, reference_gdn
from reference import relative_error
from usp_cases import topology

import usp
from usp.linear import gated_deltanet_usp
from usp.linear.backends import GdnKernels, TorchGdnKernel
from usp.linear.conv import TorchConvKernel
from usp.linear.kernel import chunk_gated_delta_rule, recurrent_gated_delta_rule
from usp.planner.traffic import gdn_traffic

TIMEOUT = 90
COMPILE_TIMEOUT = 240  # Dynamo and AOT autograd on 4 ranks sharing small CI machines


# ------------------------------------------------------------------ kernel, one process
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_kernel_matches_the_recurrence(chunk_size):
    (q, k, v, g, beta), _, dout = gdn_inputs(2, 29, 2, 4, 8, 6, 4, seed=chunk_size)
    s0 = torch.randn(2, 4, 8, 6, dtype=torch.float64)
    cu = torch.tensor([0, 3, 4, 17, 29], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    dense, final = chunk_gated_delta_rule(
        *leaves[:5], initial_state=leaves[5], output_final_state=True, scale=0.3,
        chunk_size=chunk_size, use_qk_l2norm=True,
    )  # fmt: skip
    packed, finals = chunk_gated_delta_rule(
        *leaves[:5], cu_seqlens=cu, output_final_state=True, chunk_size=chunk_size
    )
    loss = (dense * dout).sum() + final.sum() + (packed * dout).sum() + finals.pow(2).sum()
    grads = torch.autograd.grad(loss, leaves)

    ref = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    r_dense, r_final = recurrent_gated_delta_rule(
        *ref[:5], initial_state=ref[5], scale=0.3, use_qk_l2norm=True
    )
    pieces = [
        recurrent_gated_delta_rule(*(t[:, a:b] for t in ref[:5]))
        for a, b in zip(cu.tolist(), cu.tolist()[1:])
    ]
    r_packed = torch.cat([p[0] for p in pieces], 1)
    r_finals = torch.stack([p[1] for p in pieces], 1).flatten(0, 1)
    r_loss = (r_dense * dout).sum() + r_final.sum() + (r_packed * dout).sum()
    r_loss = r_loss + r_finals.pow(2).sum()
    r_grads = torch.autograd.grad(r_loss, ref)
    for a, e in [(dense, r_dense), (final, r_final), (packed, r_packed), (finals, r_finals)]:
        assert relative_error(a, e) < 1e-12
    for a, e in zip(grads, r_grads):
        assert relative_error(a, e) < 1e-11


def test_kernels_match_transformers_in_float32():
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    (q, k, v, g, beta), _, _ = gdn_inputs(2, 70, 2, 4, 16, 8, 4, seed=3, dtype=torch.float32)
    s0 = torch.randn(2, 4, 16, 8)
    mine, mine_final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True
    )
    rec, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    theirs, theirs_final = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    their_rec, _ = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True
    )
    assert mine.dtype == torch.float32
    assert relative_error(mine, theirs) < 2e-5
    assert relative_error(mine_final, theirs_final) < 2e-5
    assert relative_error(rec, their_rec) < 2e-5


def test_bfloat16_computes_in_float32():
    (q, k, v, g, beta), _, _ = gdn_inputs(1, 20, 1, 2, 8, 8, 4, seed=4)
    low = [t.to(torch.bfloat16) for t in (q, k, v, g, beta)]
    out, final = chunk_gated_delta_rule(*low, output_final_state=True, use_qk_l2norm=True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    ref, _ = recurrent_gated_delta_rule(*(t.double() for t in low), use_qk_l2norm=True)
    assert relative_error(out.double(), ref) < 2e-2


def test_one_process_path_matches_the_reference_with_short_documents():
    inputs, ws, _ = gdn_inputs(1, 23, 2, 4, 8, 6, 4, seed=5)
    cu = torch.tensor([0, 1, 3, 12, 23], dtype=torch.int32)  # documents shorter than the kernel
    out = gated_deltanet_usp(*inputs, None, conv_weights=ws, packed=cu, chunk_size=4)
    assert relative_error(out, reference_gdn(*inputs, ws, cu)) < 1e-12
    plain = gated_deltanet_usp(*inputs, None, activation=None, use_qk_l2norm=False, scale=0.5)
    q, k, v, g, beta = inputs
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.5)
    assert relative_error(plain, ref) < 1e-12


# ------------------------------------------------------------------ 4 gloo ranks
def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def run_gdn_case(
    ulysses, ring, layout, kind, conv, seed, placement="ulysses-in-node", kernel="auto",
    compiled=None, lengths=(5, 1, 17, 3, 9),
):  # fmt: skip
    """``kernel="fla"``: the usp[fla] paths' argument mappings, on CPU stand-ins of fla's
    and causal-conv1d's functions (tests/helpers/fla_standin.py). ``compiled``: a
    ``torch.compile`` of gated_deltanet_usp to call (packed documents as a PackedSequence)
    instead; ``lengths``: the documents before padding."""
    fla = standin_kernel() if kernel == "fla" else None
    kernels = None if fla is None else GdnKernels(TorchGdnKernel(), fla)
    # ``conv`` (the case: with a short conv) is not this (fla's stand-in conv kernel)
    conv_standin = standin_conv_kernel(channel_multiple=1) if kernel == "fla" else None
    conv_kernels = (
        None
        if conv_standin is None
        else {"torch": TorchConvKernel(), "causal_conv1d": conv_standin}
    )
    topo = topology(ulysses, ring, placement)
    plan = usp.Plan(topo, layout=layout)
    hk, heads = (1, 4) if ulysses == 4 else (2, 4)  # u4: key heads repeated for the split
    if kind == "packed":
        raw = _cu(list(lengths))
        cu = usp.pad_documents(raw, topo, layout=layout).cu_seqlens
        batch, seq_len = 1, int(cu[-1])
    else:
        cu, batch, seq_len = None, 2, 4 * ring * 2 * 3
    inputs, ws, dout = gdn_inputs(batch, seq_len, hk, heads, 8, 6, 4, seed=seed)
    ws = ws if conv else None
    activation = "silu" if seed % 2 else None

    ref_in = [t.clone().requires_grad_() for t in inputs]
    ref_ws = None if ws is None else [w.clone().requires_grad_() for w in ws]
    expected = reference_gdn(*ref_in, ref_ws, cu, activation=activation)
    leaves = ref_in + (ref_ws or [])
    expected_grads = torch.autograd.grad(expected, leaves, dout)

    local = [plan.shard(t, packed=cu).requires_grad_() for t in inputs]
    my_ws = None if ws is None else [w.clone().requires_grad_() for w in ws]
    topo.comm_stats.reset()
    call, packed = gated_deltanet_usp, cu
    if compiled is not None:  # a compiled graph takes packed documents built outside it
        call, packed = compiled, None if cu is None else plan.pack(cu)
    out = call(
        *local, plan, conv_weights=my_ws, packed=packed, activation=activation, chunk_size=3,
        kernel=kernel, kernels=kernels,
        conv_kernel="causal_conv1d" if conv and conv_standin else "auto",
        conv_kernels=conv_kernels,
    )  # fmt: skip
    forward_bytes = topo.comm_stats.snapshot()
    out.backward(plan.shard(dout, packed=cu))
    backward_bytes = {
        kind: {key: n - forward_bytes.get(kind, {}).get(key, 0) for key, n in counts.items()}
        for kind, counts in topo.comm_stats.snapshot().items()
    }
    grads = [plan.gather(t.grad, packed=cu) for t in local]
    for w in my_ws or []:  # a replicated weight's gradient: the sum over the SP ranks
        dist.all_reduce(w.grad, group=topo.sp_group)
        grads.append(w.grad)
    errors = {"out": relative_error(plan.gather(out.detach(), packed=cu), expected)}
    names = ["dq", "dk", "dv", "dg", "dbeta", "dwq", "dwk", "dwv"]
    errors.update({n: relative_error(a, e) for n, a, e in zip(names, grads, expected_grads)})
    docs = 1 if cu is None else len(plan.pack(cu, agree_ranks=False).documents.lengths)
    shape = {"batch": batch, "seq_len": seq_len, "hk": hk, "heads": heads, "docs": docs}
    shape["kernel"] = 4 if conv else 1
    if fla is not None:  # what reached fla's function: the ring's [0 | I] start states
        call = fla._function.calls[-1]
        shape["fla_state"] = tuple(call["initial_state"].shape)
        if conv:
            shape["conv_context"] = tuple(conv_standin._function.calls[-1]["initial_states"].shape)
    return errors, forward_bytes, backward_bytes, shape


def expected_bytes(u, r, layout, segments_per_piece, batch, seq_len, hk, heads, kernel):
    """docs/models.md's formula (float64 everywhere here: 8-byte elements; dk 8, dv 6)."""
    dk, dv, e = 8, 6, 8
    times = math.lcm(hk, u) // hk  # key heads repeated so that u ranks split them
    key_channels = hk * times * dk
    tokens = batch * seq_len // (u * r)
    a2a = tokens * (2 * key_channels + heads * dv + 2 * heads) * e * (u - 1) // u
    a2a += tokens * heads * dv * e * (u - 1) // u
    segments = (2 if layout == "zigzag" else 1) * segments_per_piece
    chained = layout == "zigzag" or r > 1
    ring = 0
    if r > 1 and chained:
        tails = (kernel - 1) * (2 * key_channels + heads * dv) // u
        maps = heads // u * dk * (dk + dv)
        ring = (r - 1) * batch * segments * (tails + maps) * e
    return a2a, ring


def planned_bytes(u, r, layout, batch, seq_len, hk, heads, kernel, docs):
    """The forward's (all-to-all, all-gather) bytes of usp.planner.traffic.gdn_traffic,
    which ``usp plan`` counts per GDN layer, for the same shape (backward: the same)."""
    traffic = gdn_traffic(
        batch=batch, seqlen=seq_len, ulysses=u, ring=r, key_heads=hk, heads=heads,
        key_dim=8, value_dim=6, kernel=kernel, layout=layout, documents=docs,
        item_bytes=8, gate_bytes=8, state_bytes=8,
    )  # fmt: skip
    forward, backward = traffic["forward"], traffic["backward"]
    a2a = forward.get("all_to_all", {}).get("sent", 0)
    ring = forward.get("all_gather", {}).get("sent", 0)
    assert backward.get("all_to_all", {}).get("sent", 0) == a2a
    assert backward.get("reduce_scatter", {}).get("sent", 0) == ring
    return a2a, ring


GRIDS = [(1, 4), (2, 2), (4, 1)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"u{u}r{r}" for u, r in GRIDS])
def test_gdn_usp_matches_one_process(distributed, grid):
    failures = []
    cases = [
        ("zigzag", "dense", True),
        ("contiguous", "packed", True),
        ("zigzag", "packed", True),
        ("contiguous", "dense", False),
    ]
    for seed, case in enumerate(cases):
        results = distributed.run(run_gdn_case, *grid, *case, seed, world_size=4, timeout=TIMEOUT)
        layout, kind, _ = case
        for rank, (errors, forward, backward, shape) in enumerate(results):
            for name, err in errors.items():
                if not err < 1e-10:
                    failures.append(f"{grid} {case} rank {rank} {name}: {err:.3g}")
            docs = shape.pop("docs")
            a2a, ring = expected_bytes(*grid, layout, docs, **shape)
            planned = planned_bytes(*grid, layout, **shape, docs=docs)  # usp plan's formula
            if planned != (a2a, ring):
                failures.append(f"{grid} {case}: usp.planner's bytes {planned} != {a2a, ring}")
            got = {k: forward.get(k, {}).get("sent", 0) for k in ("all_to_all", "all_gather")}
            back = {k: backward.get(k, {}).get("sent", 0) for k in ("all_to_all", "reduce_scatter")}
            if got != {"all_to_all": a2a, "all_gather": ring}:
                failures.append(f"{grid} {case} rank {rank} forward bytes {got} != {a2a, ring}")
            if back != {"all_to_all": a2a, "reduce_scatter": ring}:
                failures.append(f"{grid} {case} rank {rank} backward bytes {back} != {a2a, ring}")
    assert not failures, "\n".join(failures)


#: two packings of the same padded length (5 and 4 documents) for the compiled graph
COMPILED_LENGTHS = ((5, 1, 17, 3, 9), (7, 15, 9, 12))


def run_ring_in_node_cases():
    """u2 x r2, zigzag, packed: usp's torch kernel, then fla's path on its stand-in; then
    gated_deltanet_usp compiled (fullgraph; AOT autograd's forward and backward graphs,
    without Inductor's code generation, which takes minutes on 4 ranks sharing two
    cores: Inductor runs in tests/train/test_train_compile.py) on two packings: the
    all-to-alls functional collectives of the graph, the conv tails' and state maps'
    all-gathers inside the ring block's op (its backward recomputes them)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    case = (2, 2, "zigzag", "packed", True, 1, "ring-in-node")
    eager = run_gdn_case(*case), run_gdn_case(*case, kernel="fla")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(gated_deltanet_usp, fullgraph=True, backend="aot_eager")
    errors, lengths = [], []
    for index, raw in enumerate(COMPILED_LENGTHS):
        # the second packing reuses the first one's graph (a recompile is an error)
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            result = run_gdn_case(*case, compiled=compiled, lengths=raw)
        errors.append(result[0])
        lengths.append(result[3]["seq_len"])
    graphs = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    return eager, (errors, lengths, graphs)


def test_gdn_usp_with_the_ring_inside_a_node(distributed):
    """ "ring-in-node": the ring's ranks are adjacent, Ulysses strides across them; the
    second case runs the recurrence through the fla kernel's mapping (a CPU stand-in);
    the third compiles the call (one graph for both packings, exact in float64)."""
    results = distributed.run(run_ring_in_node_cases, world_size=4, timeout=COMPILE_TIMEOUT)
    for (torch_case, fla_case), (compiled_errors, lengths, graphs) in results:
        for errors in (torch_case[0], fla_case[0], *compiled_errors):
            assert all(err < 1e-10 for err in errors.values()), errors
        assert len(compiled_errors) == 2 and len(set(lengths)) == 1, lengths
        assert graphs == (1, 0), graphs  # one graph, no break
        shape = fla_case[3]  # 5 documents x 2 zigzag pieces; 2 of 4 heads; dv 6 + dk 8
        assert shape["fla_state"] == (2 * shape["docs"], 2, 8, 14), shape
        # the ring's conv tails: (2*2*8 + 4*6) / u2 channels, K - 1 = 3
        assert shape["conv_context"] == (2 * shape["docs"], 28, 3), shape


# ------------------------------------------------------------------ refusals
def run_refusals():
    """Each bad call raises the same error on every rank, moves no bytes, and leaves the
    groups usable (a valid call after it is exact)."""
    topo = topology(2, 2)
    plan = usp.Plan(topo, layout="contiguous")
    rank = dist.get_rank()
    inputs, ws, _ = gdn_inputs(1, 16, 2, 4, 8, 6, 4, seed=9)
    local = [plan.shard(t) for t in inputs]
    odd, _, _ = gdn_inputs(1, 16, 3, 3, 8, 6, 4, seed=9)  # 3 value heads over u=2
    bad_cu = torch.tensor([0, 5, 16], dtype=torch.int32)  # 5 tokens: not 2 chunks
    calls = {
        "heads": lambda: gated_deltanet_usp(*[plan.shard(t) for t in odd], plan),
        "activation": lambda: gated_deltanet_usp(*local, plan, conv_weights=ws, activation="gelu"),
        "documents": lambda: gated_deltanet_usp(*local, plan, packed=bad_cu),
        "shape_on_one_rank": lambda: gated_deltanet_usp(
            *[t[:, :2] if rank == 3 else t for t in local], plan
        ),
        "chunk_size": lambda: gated_deltanet_usp(*local, plan, chunk_size=0),
        "conv_weights": lambda: gated_deltanet_usp(*local, plan, conv_weights=ws[:2]),
        "kernel": lambda: gated_deltanet_usp(*local, plan, kernel="fla"),  # no fla on a CPU
        "conv_kernel": lambda: gated_deltanet_usp(
            *local, plan, conv_weights=ws, conv_kernel="causal_conv1d"
        ),
        "kernel_on_one_rank": lambda: gated_deltanet_usp(
            *local, plan, kernel="torch" if rank == 1 else "auto"
        ),
    }
    messages = {}
    for name, call in calls.items():
        topo.comm_stats.reset()
        try:
            call()
            messages[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the test compares type and text
            messages[name] = f"{type(err).__name__}: {err}"
        assert topo.comm_stats.total_sent == 0, (name, topo.comm_stats.snapshot())
    out = gated_deltanet_usp(*local, plan, conv_weights=ws)
    error = relative_error(plan.gather(out), reference_gdn(*inputs, ws))
    dist.barrier()
    return messages, error


EXPECTED = {
    "heads": ("UlyssesHeadError", "gated_deltanet_usp failed on ranks 0, 1, 2, 3", "ulysses"),
    "activation": ("LinearAttentionError", "activation must be one of"),
    "documents": ("ShardingError", "multiple of 2"),
    "shape_on_one_rank": ("RankDisagreementError", "disagree on q shape"),
    "chunk_size": ("LinearAttentionError", "chunk_size must be a positive int"),
    "conv_weights": ("LinearAttentionError", "conv_weights must be (wq, wk, wv)"),
    "kernel": ("GdnKernelError", "GDN kernel 'fla' cannot run this call (cpu"),
    "conv_kernel": ("ConvKernelError", "conv kernel 'causal_conv1d' cannot run this call (cpu"),
    "kernel_on_one_rank": ("RankDisagreementError", "disagree on GDN kernel", "rank 1: torch"),
}


def test_refusals_are_the_same_on_every_rank_before_any_traffic(distributed):
    results = distributed.run(run_refusals, world_size=4, timeout=60)
    for name, parts in EXPECTED.items():
        messages = {messages[name] for messages, _ in results}
        assert len(messages) == 1, f"{name}: ranks raised different errors: {messages}"
        message = messages.pop()
        for part in parts:
            assert part in message, message
    assert all(error < 1e-10 for _, error in results)


def test_kernel_benchmark_runs_and_agrees_with_transformers():
    pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from benchmarks import gdn_kernel

    row = gdn_kernel.main(["--seq-len", "96", "--heads", "2", "--dim", "16", "--repeats", "1",
                           "--chunk-size", "32", "--batch", "2"])  # fmt: skip
    assert row["max_abs_difference"] < 1e-5
    assert row["usp_s"] > 0 and row["transformers_s"] > 0
    forward = gdn_kernel.main(["--seq-len", "64", "--repeats", "1", "--no-backward",
                               "--threads", "1"])  # fmt: skip
    assert forward["max_abs_difference"] < 1e-5
    ring = gdn_kernel.main(["--ring-degree", "4", "--seq-len", "64", "--dim", "8", "--repeats",
                            "1", "--heads", "2"])  # fmt: skip
    # zigzag: 2 segments; all-gather forward + reduce-scatter backward, float32
    tails, maps = 3 * 3 * 2 * 8, 2 * 8 * 16
    assert ring["bytes_sent"] == 2 * (4 - 1) * 2 * (tails + maps) * 4
    assert ring["ring_s"] > 0 and ring["alone_s"] > 0

"""USP attention on 4 and 8 gloo ranks against a single-process float64 reference.

Every (ulysses, ring) grid the issue lists, with MHA, GQA whose KV heads split over
the Ulysses group, and GQA with more Ulysses ranks than KV heads (KV replication);
causal and not; both layouts; both ring implementations; float32 and bfloat16.
Tolerances as for the ring: float32 1e-5 relative (measured <= 1e-6), bfloat16 2e-2
for out and 4e-2 for gradients (measured <= 1.5e-2). The same calls' bytes: every
rank's sent and received bytes and calls per collective kind, forward and backward,
equal ``traffic_formula`` (benchmarks/emulate.py) exactly; the grid with data
parallelism is tests/attention/test_traffic.py's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from usp_cases import (
    global_inputs,
    reference_with_grads,
    stated_traffic,
    topology,
    usp_errors,
)

import usp
from usp.sp import sharding

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 4e-2)}
HEAD_CONFIGS = {"mha": (8, 8), "gqa-split": (16, 8), "gqa-replicated": (8, 2)}


LOCAL_LEN = 8  # tokens per rank


def run_grid(ulysses, ring, ring_impl):
    """Every case's errors and the bytes its forward and backward moved on this rank."""
    topo = topology(ulysses, ring)
    world = dist.get_world_size()
    results = []
    for (heads_name, (heads, kv_heads)), causal in itertools.product(
        HEAD_CONFIGS.items(), (False, True)
    ):
        inputs = global_inputs(LOCAL_LEN * world, heads, kv_heads, seed=heads + kv_heads)
        expected = reference_with_grads(*inputs, causal=causal)
        for layout, dtype in itertools.product(
            ("zigzag", "contiguous"), (torch.float32, torch.bfloat16)
        ):
            traffic = {}
            errors = usp_errors(
                topo,
                inputs,
                expected,
                dtype=dtype,
                layout=layout,
                causal=causal,
                ring_impl=ring_impl,
                traffic=traffic,
            )
            results.append(((heads_name, causal, layout, dtype), errors, traffic))
    return results


GRIDS = [(8, (8, 1)), (8, (4, 2)), (8, (2, 4)), (8, (1, 8)), (4, (4, 1)), (4, (2, 2)), (4, (1, 4))]


@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
@pytest.mark.parametrize("world,grid", GRIDS, ids=[f"{w}ranks-u{u}r{r}" for w, (u, r) in GRIDS])
def test_usp_matches_single_process_reference(distributed, world, grid, ring_impl):
    if grid[1] == 1 and ring_impl == "allgather":
        pytest.skip("ring of one: no ring implementation runs")
    failures = []
    for rank, results in enumerate(
        distributed.run(run_grid, *grid, ring_impl, world_size=world, timeout=300)
    ):
        for (heads, causal, layout, dtype), errors, traffic in results:
            out_tol, grad_tol = TOL[dtype]
            for name, err in errors.items():
                if err > (out_tol if name == "out" else grad_tol):
                    failures.append(
                        f"rank {rank} {heads} causal={causal} {layout} {dtype}: {name} {err:.3g}"
                    )
            u, r = grid
            want = stated_traffic(
                *HEAD_CONFIGS[heads], ulysses=u, ring=r, ring_impl=ring_impl, dtype=dtype,
                seq_len=LOCAL_LEN * u * r,
            )  # fmt: skip
            if traffic != want:
                failures.append(
                    f"rank {rank} {heads} causal={causal} {layout} {dtype}: "
                    f"moved {traffic}, the formula says {want}"
                )
    assert not failures, "\n".join(failures[:10])


def run_uneven_replication(heads, kv_heads, ulysses, ring):
    """KV heads that neither divide nor are divided by u (lcm replication), and MQA."""
    topo = topology(ulysses, ring)
    inputs = global_inputs(8 * dist.get_world_size(), heads, kv_heads, seed=1)
    expected = reference_with_grads(*inputs, causal=True)
    return usp_errors(
        topo, inputs, expected, dtype=torch.float32, layout="zigzag", causal=True, ring_impl="p2p"
    )


@pytest.mark.parametrize(
    "heads,kv_heads,grid", [(12, 3, (4, 1)), (12, 3, (2, 2)), (4, 1, (4, 1)), (24, 6, (4, 1))]
)
def test_kv_replication_beyond_divisible_cases(distributed, heads, kv_heads, grid):
    for errors in distributed.run(run_uneven_replication, heads, kv_heads, *grid, world_size=4):
        assert max(errors.values()) < 1e-5, errors


def run_placement(placement, ulysses, ring, ranks_per_node):
    topo = topology(ulysses, ring, placement=placement, ranks_per_node=ranks_per_node)
    inputs = global_inputs(8 * topo.sp_degree, 8, 2, seed=3)
    expected = reference_with_grads(*inputs, causal=True)
    return usp_errors(
        topo, inputs, expected, dtype=torch.float32, layout="zigzag", causal=True, ring_impl="p2p"
    )


def test_ring_in_node_placement_is_exact_too(distributed):
    # 2 "nodes" of 4 ranks; ring inside a node, Ulysses across (sp rank != group rank)
    for errors in distributed.run(run_placement, "ring-in-node", 2, 4, 4, world_size=8):
        assert max(errors.values()) < 1e-5, errors


def run_data_parallel_replicas():
    """dp=2 x (u=2, r=2): each replica attends over its own sequence."""
    topo = topology(2, 2)
    assert topo.dp_degree == 2
    inputs = global_inputs(8 * topo.sp_degree, 8, 2, seed=10 + topo.dp_rank)
    expected = reference_with_grads(*inputs, causal=True)
    return usp_errors(
        topo, inputs, expected, dtype=torch.float32, layout="zigzag", causal=True, ring_impl="p2p"
    )


def test_data_parallel_replicas_are_independent(distributed):
    for errors in distributed.run(run_data_parallel_replicas, world_size=8):
        assert max(errors.values()) < 1e-5, errors


# ------------------------------------------------------------------ sharding
def run_round_trip(ulysses, ring, placement):
    topo = topology(
        ulysses,
        ring,
        placement=placement,
        ranks_per_node=4 if placement == "ring-in-node" else None,
    )
    seq_len = 8 * topo.sp_degree
    full = torch.arange(2 * seq_len * 3).reshape(2, seq_len, 3)
    checks = []
    for layout in ("zigzag", "contiguous"):
        for dim in (1, -2):
            local = usp.shard_sequence(full, topo, dim=dim, layout=layout)
            positions = usp.local_token_indices(seq_len, topo, layout=layout)
            checks.append(bool(torch.equal(local, full[:, positions])))
            checks.append(
                bool(torch.equal(usp.gather_sequence(local, topo, dim=dim, layout=layout), full))
            )
    return checks, usp.local_token_indices(seq_len, topo, layout="zigzag").tolist(), topo.sp_rank


@pytest.mark.parametrize(
    "world,grid,placement",
    [
        (8, (8, 1), "ulysses-in-node"),
        (8, (4, 2), "ulysses-in-node"),
        (8, (2, 4), "ulysses-in-node"),
        (8, (1, 8), "ulysses-in-node"),
        (4, (2, 2), "ulysses-in-node"),
        (8, (2, 4), "ring-in-node"),
    ],
)
def test_shard_and_gather_round_trip_exactly(distributed, world, grid, placement):
    results = distributed.run(run_round_trip, *grid, placement, world_size=world)
    assert all(all(checks) for checks, _, _ in results)
    # within each SP group the shards partition the sequence
    by_sp_rank = {}
    for _, positions, sp_rank in results:
        by_sp_rank.setdefault(sp_rank, positions)
    held = sorted(p for positions in by_sp_rank.values() for p in positions)
    assert held == list(range(8 * grid[0] * grid[1]))


def test_zigzag_positions_follow_the_documented_layout():
    # S = 16, r = 2, u = 2: chunks of 4; ring rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    pos = lambda rr, ur: sharding.sequence_positions(  # noqa: E731
        16, ring_size=2, ring_rank=rr, ulysses_size=2, ulysses_rank=ur, layout="zigzag"
    ).tolist()
    assert pos(0, 0) == [0, 1, 2, 3] and pos(0, 1) == [12, 13, 14, 15]
    assert pos(1, 0) == [4, 5, 6, 7] and pos(1, 1) == [8, 9, 10, 11]


def test_pad_to_multiple():
    ids = torch.arange(10).reshape(1, 10)
    labels = ids.clone()
    assert usp.pad_to_multiple(ids, 8).tolist() == [list(range(10)) + [0] * 6]
    assert usp.pad_to_multiple(labels, 8, value=-100)[0, 10:].tolist() == [-100] * 6
    assert usp.pad_to_multiple(ids, 5) is ids
    with pytest.raises(
        usp.ShardingError,
        match="sequence length 10 must be a multiple of 4 for the zigzag layout with ring=2, ulysses=2 \\(pad to 12",
    ):
        sharding.check_sequence_length(10, 2, 2, "zigzag")


# ------------------------------------------------------------------ traffic
def run_traffic(ulysses, ring, heads, kv_heads):
    topo = topology(ulysses, ring)
    q, k, v, dout = global_inputs(8 * topo.sp_degree, heads, kv_heads)
    local = [usp.shard_sequence(t, topo).to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    topo.comm_stats.reset()
    out = usp.usp_attention(*local, topo, causal=True)
    forward = topo.comm_stats.snapshot()
    topo.comm_stats.reset()
    out.backward(usp.shard_sequence(dout, topo).to(torch.bfloat16))
    return forward, topo.comm_stats.snapshot()


@pytest.mark.parametrize(
    "grid,heads", [((4, 2), (8, 8)), ((4, 2), (8, 2)), ((2, 4), (16, 8)), ((8, 1), (8, 2))]
)
def test_usp_traffic_matches_the_formula(distributed, grid, heads):
    (u, r), (num_heads, kv_heads) = grid, heads
    batch, local_len, head_dim, item = 2, 8, 16, 2
    replicated_kv = kv_heads * usp.process_groups.kv_replication(num_heads, kv_heads, u)
    token_bytes = batch * local_len * head_dim * item  # one head of this rank's tokens
    # all-to-all: a rank keeps 1/u of what it packs and sends the rest
    qkv = (num_heads + 2 * replicated_kv) * token_bytes * (u - 1) // u
    out = num_heads * token_bytes * (u - 1) // u
    ring_len = local_len * u  # after the all-to-all
    kv_block = 2 * batch * ring_len * (replicated_kv // u) * head_dim * item
    for forward, backward in distributed.run(
        run_traffic, u, r, num_heads, kv_heads, world_size=u * r
    ):
        if u > 1:
            assert forward["all_to_all"] == {"sent": qkv + out, "received": qkv + out, "calls": 2}
            assert backward["all_to_all"] == {"sent": qkv + out, "received": qkv + out, "calls": 2}
        else:
            assert "all_to_all" not in forward and "all_to_all" not in backward
        if r > 1:
            p2p_fwd = (r - 1) * kv_block
            p2p_bwd = (r - 1) * (kv_block + kv_block * 2)  # dK/dV travel in float32
            assert forward["p2p"]["sent"] == p2p_fwd and backward["p2p"]["sent"] == p2p_bwd
        else:
            assert "p2p" not in forward and "p2p" not in backward


# ------------------------------------------------------------------ bad input
def run_bad_input(kind):
    topo = topology(4, 1)
    try:
        if kind == "heads":
            usp.usp_attention(
                torch.randn(1, 8, 6, 16), torch.randn(1, 8, 6, 16), torch.randn(1, 8, 6, 16), topo
            )
        elif (
            kind == "length"
        ):  # with an even Ulysses degree any local length works: use a pure ring
            ring_only = topology(1, 4)
            usp.usp_attention(
                torch.randn(1, 3, 8, 16),
                torch.randn(1, 3, 2, 16),
                torch.randn(1, 3, 2, 16),
                ring_only,
                causal=True,
            )
        elif kind == "batch":
            usp.usp_attention(
                torch.randn(1, 8, 8, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16), topo
            )
        elif kind == "head_dim":
            usp.usp_attention(
                torch.randn(1, 8, 8, 16), torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32), topo
            )
        elif kind == "dtype":
            usp.usp_attention(
                torch.randn(1, 8, 8, 16),
                torch.randn(1, 8, 2, 16).double(),
                torch.randn(1, 8, 2, 16),
                topo,
            )
        elif kind == "shard":
            usp.shard_sequence(torch.randn(1, 10, 8), topo)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "kind,message",
    [
        (
            "heads",
            "cannot split 6 query heads / 6 KV heads over ulysses=4: num_heads(6) is not divisible by ulysses(4)",
        ),
        (
            "heads",
            "valid (ulysses, ring) pairs for sp_size=4 with 6 heads / 6 KV heads and 4 ranks per node: (1, 4), (2, 2)",
        ),
        (
            "length",
            "sequence length 12 must be a multiple of 8 for the zigzag layout with ring=4, ulysses=1 (pad to 16",
        ),
        ("length", "each of the 4 SP ranks holds 3 tokens"),
        ("batch", "same batch size, got 1 and 2"),
        ("head_dim", "same head_dim, got 16 and 32"),
        ("dtype", "q, k and v must share a dtype"),
        (
            "shard",
            "sequence length 10 must be a multiple of 4 for the zigzag layout with ring=1, ulysses=4 (pad to 12",
        ),
    ],
)
def test_bad_input_is_explained(distributed, kind, message):
    for result in distributed.run(run_bad_input, kind, world_size=4):
        assert message in result, result


def run_module_and_inference():
    topo = topology(2, 2)
    q, k, v, _ = global_inputs(8 * topo.sp_degree, 8, 2, seed=4)
    local = [usp.shard_sequence(t, topo).float() for t in (q, k, v)]
    module = usp.UspAttention(topo, causal=True, ring_impl="allgather")
    with torch.no_grad():
        by_module = module(*local)
    by_function = usp.usp_attention(*local, topo, causal=True, ring_impl="allgather")
    # only q needs a gradient: k and v get none, and nothing fails
    q_only = local[0].clone().requires_grad_()
    usp.usp_attention(q_only, local[1], local[2], topo, causal=True).sum().backward()
    return (
        torch.equal(by_module, by_function),
        by_module.requires_grad,
        q_only.grad is not None and bool(torch.isfinite(q_only.grad).all()),
        "ulysses=2, ring=2" in repr(module),
    )


def test_module_form_inference_and_partial_gradients(distributed):
    for same, needs_grad, q_grad_ok, described in distributed.run(
        run_module_and_inference, world_size=4
    ):
        assert same and not needs_grad and q_grad_ok and described

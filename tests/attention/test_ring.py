"""Ring attention on r gloo ranks against a single-process float64 reference.

Every rank builds the same global inputs, takes its shard in the ring layout, runs
``ring_attention`` forward and backward, and compares out, dq, dk, dv with the
reference's rows at its positions. Errors are relative to the largest reference value.
Tolerances: float32 1e-5 (measured: ~1e-6); bfloat16 2e-2 for out and 4e-2 for the
gradients (measured: <= 1.5e-2), the same as the local kernels' bf16 bounds.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from reference import relative_error
from usp_cases import global_inputs, reference_with_grads

from usp.comm.stats import CommStats
from usp.ring import ring_attention
from usp.sp.sharding import sequence_positions

TOL = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 4e-2)}  # (out, grads)
HEADS = {"mha": (4, 4), "gqa": (4, 2)}


def run_ring_case(
    layout, ring_impl, causal, heads, dtype_name, local_len=16, kv_head_chunks=1, seed=0
):
    """On every rank of WORLD: ring attention vs the reference; returns relative errors
    and this rank's byte counters (forward and backward separately)."""
    ring_size, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    num_heads, kv_heads = HEADS[heads]
    q, k, v, dout = global_inputs(local_len * ring_size, num_heads, kv_heads, seed=seed)
    expected = reference_with_grads(q, k, v, dout, causal)
    positions = sequence_positions(q.shape[1], ring_size=ring_size, ring_rank=rank, layout=layout)
    local = [t[:, positions].to(dtype).requires_grad_() for t in (q, k, v)]
    stats = CommStats()
    out = ring_attention(
        *local,
        dist.group.WORLD,
        causal=causal,
        layout=layout,
        ring_impl=ring_impl,
        comm_stats=stats,
        kv_head_chunks=kv_head_chunks,
    )
    forward_bytes = stats.snapshot()
    stats.reset()
    out.backward(dout[:, positions].to(dtype))
    actual = [out.detach(), *(t.grad for t in local)]
    assert all(a.dtype == dtype for a in actual), [a.dtype for a in actual]
    errors = {
        name: relative_error(a, e[:, positions])
        for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected)
    }
    return {"errors": errors, "forward": forward_bytes, "backward": stats.snapshot()}


CASES = list(itertools.product([False, True], HEADS, ["float32", "bfloat16"]))


@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring_size", [2, 3, 4, 8])
def test_ring_matches_single_process_reference(distributed, ring_size, layout, ring_impl):
    failures = []
    for causal, heads, dtype in CASES:
        results = distributed.run(
            run_ring_case, layout, ring_impl, causal, heads, dtype, world_size=ring_size
        )
        out_tol, grad_tol = TOL[dtype]
        for rank, result in enumerate(results):
            for name, err in result["errors"].items():
                if err > (out_tol if name == "out" else grad_tol):
                    failures.append(
                        f"causal={causal} {heads} {dtype} rank {rank} {name}: {err:.3g}"
                    )
    assert not failures, "\n".join(failures)


def test_allgather_in_kv_head_chunks(distributed):
    results = distributed.run(
        run_ring_case, "zigzag", "allgather", True, "gqa", "float32", kv_head_chunks=2, world_size=4
    )
    for result in results:
        assert max(result["errors"].values()) < 1e-5, result["errors"]
        assert result["forward"]["all_gather"]["calls"] == 2


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_p2p_in_kv_head_chunks_equals_one_pass(distributed, layout, dtype):
    """The p2p ring once per group of KV heads (2 groups of 1 KV head, 2 query heads):
    against the reference, with errors equal to one pass over all heads on every rank
    (heads are independent; measured: identical here, but the CPU kernel blocks its
    work by the head count, so only rounding-level equality is asserted); the same
    bytes in twice the messages."""
    one, chunked = (
        distributed.run(
            run_ring_case, layout, "p2p", True, "gqa", dtype, kv_head_chunks=chunks, world_size=4
        )
        for chunks in (1, 2)
    )
    out_tol, grad_tol = TOL[dtype]
    for a, b in zip(one, chunked):
        assert all(abs(b["errors"][n] - e) <= 1e-6 for n, e in a["errors"].items())
        assert b["errors"]["out"] <= out_tol and max(b["errors"].values()) <= grad_tol
        for pass_ in ("forward", "backward"):
            assert b[pass_]["p2p"]["sent"] == a[pass_]["p2p"]["sent"] > 0
            assert b[pass_]["p2p"]["calls"] == 2 * a[pass_]["p2p"]["calls"]


def test_bf16_gradient_error_does_not_grow_with_ring_size(distributed):
    """Same global problem (256 tokens) on rings of 2 and 8: float32 accumulation of dq
    and of the travelling dK/dV keeps the bf16 error flat (ring-flash-attention #22/#42).
    Measured (relative to the largest reference value): r=2 dq 6.7e-3 dk 8.1e-3 dv 9.0e-3;
    r=8 dq 8.5e-3 dk 7.4e-3 dv 8.5e-3. "Not materially worse" is asserted as <= 1.5x."""
    worst = {}
    for ring_size in (2, 8):
        results = distributed.run(
            run_ring_case,
            "zigzag",
            "p2p",
            True,
            "gqa",
            "bfloat16",
            local_len=256 // ring_size,
            seed=7,
            world_size=ring_size,
        )
        worst[ring_size] = {n: max(r["errors"][n] for r in results) for n in ("dq", "dk", "dv")}
    for name in ("dq", "dk", "dv"):
        assert worst[8][name] <= 1.5 * worst[2][name], worst


def _float32_gradients_are_independent(ring_impl):
    q, k, v, dout = (t.float() for t in global_inputs(32, 4, 2))
    local = [t[:, :16].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD, causal=True, ring_impl=ring_impl)
    out.backward(dout[:, :16])
    grads = [t.grad for t in local]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    before = grads[2].clone()
    grads[1].add_(1.0)  # an optimizer touching dk must not change dv
    return len(storages), torch.equal(before, grads[2])


@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
def test_float32_gradients_do_not_alias(distributed, ring_impl):
    for distinct, untouched in distributed.run(
        _float32_gradients_are_independent, ring_impl, world_size=2
    ):
        assert distinct == 3 and untouched


def _kv_bytes(local_len, kv_heads, itemsize, batch=2, head_dim=16):
    return 2 * batch * local_len * kv_heads * head_dim * itemsize  # K and V of one block


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("ring_impl", ["p2p", "allgather"])
def test_traffic_matches_the_formula(distributed, ring_impl, heads):
    ring_size, local_len = 4, 16
    results = distributed.run(
        run_ring_case, "zigzag", ring_impl, True, heads, "bfloat16", world_size=ring_size
    )
    kv_heads = HEADS[heads][1]
    block = _kv_bytes(local_len, kv_heads, itemsize=2)
    block_grads_fp32 = _kv_bytes(local_len, kv_heads, itemsize=4)
    for result in results:
        fwd, bwd = result["forward"], result["backward"]
        if ring_impl == "p2p":
            # forward: r-1 K/V blocks; backward: r-1 K/V blocks + r-1 float32 dK/dV blocks
            assert fwd == {
                "p2p": {
                    "sent": (ring_size - 1) * block,
                    "received": (ring_size - 1) * block,
                    "calls": ring_size - 1,
                }
            }
            moved = (ring_size - 1) * (block + block_grads_fp32)
            assert bwd == {"p2p": {"sent": moved, "received": moved, "calls": 2 * (ring_size - 1)}}
        else:
            gather = {
                "sent": (ring_size - 1) * block,
                "received": (ring_size - 1) * block,
                "calls": 1,
            }
            assert fwd == {"all_gather": gather}
            scatter = (ring_size - 1) * block_grads_fp32
            assert bwd == {
                "all_gather": gather,
                "reduce_scatter": {"sent": scatter, "received": scatter, "calls": 1},
            }


def _ring_of_one_case():
    from dist_harness import worker_cached

    singles = worker_cached(
        "single-rank groups", lambda: [dist.new_group([r]) for r in range(dist.get_world_size())]
    )
    q, k, v, dout = global_inputs(12, 4, 2)
    expected = reference_with_grads(q, k, v, dout, causal=True)
    local = [t.float().requires_grad_() for t in (q, k, v)]
    stats = CommStats()
    out = ring_attention(*local, singles[dist.get_rank()], causal=True, comm_stats=stats)
    out.backward(dout.float())
    errors = [
        relative_error(a, e) for a, e in zip([out.detach(), *(t.grad for t in local)], expected)
    ]
    return stats.snapshot(), max(errors)


def test_ring_of_one_does_no_communication(distributed):
    for counters, error in distributed.run(_ring_of_one_case, world_size=2):
        assert counters == {}
        assert error < 1e-5


def _bad_input_case(kind):
    rank = dist.get_rank()
    q = torch.randn(1, 8, 4, 16)
    kv = torch.randn(1, 8, 2, 16)
    try:
        if kind == "odd_zigzag":
            ring_attention(q[:, :7], kv[:, :7], kv[:, :7], dist.group.WORLD, causal=True)
        elif kind == "shapes_differ":
            n = 8 if rank == 0 else 6
            ring_attention(q[:, :n], kv[:, :n], kv[:, :n], dist.group.WORLD)
        elif kind == "meta_device":
            ring_attention(q.to("meta"), kv.to("meta"), kv.to("meta"), dist.group.WORLD)
        elif kind == "layout":
            ring_attention(q, kv, kv, dist.group.WORLD, layout="striped")
        elif kind == "impl":
            ring_attention(q, kv, kv, dist.group.WORLD, ring_impl="ulysses")
        elif kind == "head_chunks":
            ring_attention(q, kv, kv, dist.group.WORLD, ring_impl="allgather", kv_head_chunks=3)
        elif kind == "p2p_head_chunks":
            ring_attention(q, kv, kv, dist.group.WORLD, kv_head_chunks=0)
        elif kind == "head_chunks_differ":
            ring_attention(q, kv, kv, dist.group.WORLD, kv_head_chunks=1 + rank)
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    "kind,message",
    [
        (
            "odd_zigzag",
            "zigzag layout needs the local sequence length to be a multiple of 2 (global length a multiple of 4 on a ring of 2), got 7",
        ),
        (
            "shapes_differ",
            "RankDisagreementError: ring_attention: the ranks of the group disagree on q.shape[1] (rank 0: 8; rank 1: 6)",
        ),
        ("meta_device", "the ring group uses gloo; pass CPU tensors (got meta)"),
        ("layout", "unknown sequence layout 'striped'; valid: zigzag, contiguous"),
        ("impl", "unknown ring_impl 'ulysses'; valid: p2p, allgather"),
        ("head_chunks", "kv_head_chunks=3 must be >= 1 and divide the local KV heads (2)"),
        ("p2p_head_chunks", "kv_head_chunks=0 must be >= 1 and divide the local KV heads (2)"),
        (
            "head_chunks_differ",
            "the ranks of the group disagree on kv_head_chunks (rank 0: 1; rank 1: 2)",
        ),
    ],
)
def test_bad_input_is_explained(distributed, kind, message):
    for result in distributed.run(_bad_input_case, kind, world_size=2):
        assert message in result, result

"""When something goes wrong: the same clear error on every rank, no hang, no abort,
and the process groups usable afterwards (issue: errors before the first send,
cross-rank agreement, NaN not hidden).

Every case runs on 2 gloo ranks. After the failing call, each rank makes a valid call
and a barrier: a group left half-way through a collective would hang there, and the
harness's short timeout (``TIMEOUT``) turns that hang into a failure with every rank's
stack.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention, relative_error
from usp_cases import topology

import usp

TIMEOUT = 60  # seconds: a hang fails fast


def _inputs(total, heads=4, kv_heads=2, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, total, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)
    ]


def _still_usable(topo) -> float:
    """A valid call and a barrier after the failure; returns the call's error."""
    q, k, v = _inputs(16, dtype=torch.float64)
    local = [usp.shard_sequence(t, topo) for t in (q, k, v)]
    out = usp.usp_attention(*local, topo, causal=True)
    full = usp.gather_sequence(out, topo)
    dist.barrier(group=topo.sp_group)
    dist.barrier()
    expected, _ = reference_attention(q, k, v, causal=True)
    return relative_error(full, expected)


def _error_then_usable(topo, call) -> tuple[str, float]:
    try:
        call()
        message = "no error"
    except Exception as err:  # noqa: BLE001 - the test compares type and text
        message = f"{type(err).__name__}: {err}"
    return message, _still_usable(topo)


def _assert_same_error_everywhere(results, *expected_parts):
    messages = {message for message, _ in results}
    assert len(messages) == 1, f"ranks raised different errors: {messages}"
    message = messages.pop()
    for part in expected_parts:
        assert part in message, message
    for _, error in results:
        assert error < 1e-10, "the valid call after the failure is wrong"


# ------------------------------------------------------------------ 1. errors before sending
def run_unavailable_backend(ulysses, ring, verify):
    topo = topology(ulysses, ring)
    local = [usp.shard_sequence(t, topo) for t in _inputs(16)]
    return _error_then_usable(
        topo,
        lambda: usp.usp_attention(*local, topo, causal=True, backend="cudnn", verify=verify),
    )


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)])
@pytest.mark.parametrize("verify", [True, False])
def test_unavailable_backend_fails_before_anything_is_sent(distributed, ulysses, ring, verify):
    results = distributed.run(
        run_unavailable_backend, ulysses, ring, verify, world_size=2, timeout=TIMEOUT
    )
    _assert_same_error_everywhere(results, "BackendUnavailableError", "'cudnn'")


def run_bad_scale(value, verify):
    topo = topology(1, 2)
    local = [usp.shard_sequence(t, topo) for t in _inputs(16)]
    return _error_then_usable(
        topo,
        lambda: usp.usp_attention(*local, topo, causal=True, softmax_scale=value, verify=verify),
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
def test_bad_softmax_scale_is_an_error_on_every_rank(distributed, value):
    results = distributed.run(run_bad_scale, value, False, world_size=2, timeout=TIMEOUT)
    _assert_same_error_everywhere(results, "softmax_scale")


def run_scale_bad_on_one_rank():
    """Only rank 1 passes a NaN scale: with agreement every rank raises rank 1's error."""
    topo = topology(1, 2)
    local = [usp.shard_sequence(t, topo) for t in _inputs(16)]
    scale = float("nan") if dist.get_rank() == 1 else 0.25
    return _error_then_usable(
        topo, lambda: usp.usp_attention(*local, topo, causal=True, softmax_scale=scale)
    )


def test_one_rank_with_bad_input_fails_every_rank(distributed):
    results = distributed.run(run_scale_bad_on_one_rank, world_size=2, timeout=TIMEOUT)
    _assert_same_error_everywhere(results, "failed on rank 1 of 2", "softmax_scale")


# ------------------------------------------------------------------ 2. ranks that disagree
def run_disagreement(kind):
    rank = dist.get_rank()
    grid = {"length_u2": (2, 1), "dtype_u2": (2, 1), "dtype_ring": (1, 2)}.get(kind, (1, 2))
    topo = topology(*grid)
    q, k, v = (usp.shard_sequence(t, topo) for t in _inputs(32))
    options = {"causal": True}
    if kind == "length_u2":
        n = 16 if rank == 0 else 12
        q, k, v = q[:, :n], k[:, :n], v[:, :n]
    elif kind == "dtype_u2":
        q, k, v = (t.to(torch.bfloat16 if rank == 0 else torch.float16) for t in (q, k, v))
    elif kind == "dtype_ring":
        q, k, v = (t.to(torch.float32 if rank == 0 else torch.bfloat16) for t in (q, k, v))
    elif kind == "cu_seqlens":
        options["cu_seqlens"] = torch.tensor([0, 8 if rank == 0 else 16, 32], dtype=torch.int32)
    elif kind == "causal":
        options["causal"] = rank == 0
    elif kind == "layout":
        options["layout"] = "zigzag" if rank == 0 else "contiguous"
    elif kind == "ring_impl":
        options["ring_impl"] = "p2p" if rank == 0 else "allgather"
    elif kind == "scale":
        options["softmax_scale"] = 0.5 if rank == 0 else None
    elif kind == "grad":
        q.requires_grad_(rank == 0)
    return _error_then_usable(topo, lambda: usp.usp_attention(q, k, v, topo, **options))


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("length_u2", "disagree on q.shape[1] (rank 0: 16; rank 1: 12)"),
        ("dtype_u2", "disagree on dtype (rank 0: torch.bfloat16; rank 1: torch.float16)"),
        ("dtype_ring", "disagree on dtype (rank 0: torch.float32; rank 1: torch.bfloat16)"),
        ("cu_seqlens", "disagree on documents (cu_seqlens)"),
        ("causal", "disagree on causal (rank 0: 1; rank 1: 0)"),
        ("layout", "disagree on layout (rank 0: 'zigzag'; rank 1: 'contiguous')"),
        ("ring_impl", "disagree on ring_impl (rank 0: 'p2p'; rank 1: 'allgather')"),
        ("scale", "disagree on softmax_scale (rank 0: 0.5; rank 1: default (head_dim**-0.5))"),
        ("grad", "disagree on needs_grad (rank 0: q requires grad; rank 1: no grad)"),
    ],
)
def test_ranks_that_disagree_get_the_same_error(distributed, kind, expected):
    results = distributed.run(run_disagreement, kind, world_size=2, timeout=TIMEOUT)
    _assert_same_error_everywhere(results, "RankDisagreementError", "usp_attention: ", expected)


# ------------------------------------------------------------------ 3/4. NaN and infinity
def run_nan_query_row(ulysses, ring, backend):
    topo = topology(ulysses, ring)
    q, k, v = _inputs(16)
    q[0, 5, 1] = float("nan")  # one row of one head
    local = [usp.shard_sequence(t, topo) for t in (q, k, v)]
    out = usp.gather_sequence(usp.usp_attention(*local, topo, causal=True, backend=backend), topo)
    nan = torch.isnan(out)
    return nan[0, 5, 1].all().item(), nan.sum().item(), out.shape[-1]


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)])
def test_nan_in_a_query_row_comes_back_nan(distributed, ulysses, ring, backend):
    for row_is_nan, nan_count, dim in distributed.run(
        run_nan_query_row, ulysses, ring, backend, world_size=2, timeout=TIMEOUT
    ):
        assert row_is_nan, "the NaN query row came back as numbers"
        assert nan_count == dim, "NaN leaked into rows it does not reach"


def run_infinite_key_block(backend):
    """Ring rank 1's whole block of keys is -inf along q's direction: every score of every
    row against that block is -inf, so the block must count for nothing in the merge."""
    topo = topology(1, 2)
    q, k, v = (t.double() for t in _inputs(16))
    q = q.abs() + 0.1  # positive, so q . k = -inf exactly where k = -inf
    held = usp.local_token_indices(16, topo).tolist()  # zigzag, r = 2: rank 1 holds 4..11
    k_inf = k.clone()
    k_inf[:, 4:12] = float("-inf")
    local = [usp.shard_sequence(t, topo) for t in (q, k_inf, v)]
    out = usp.gather_sequence(usp.usp_attention(*local, topo, backend=backend), topo)
    expected, _ = reference_attention(q, k_inf, v)
    return relative_error(out, expected), held


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_a_block_of_infinite_keys_counts_for_nothing(distributed, backend):
    results = distributed.run(run_infinite_key_block, backend, world_size=2, timeout=TIMEOUT)
    assert sorted(sum((held for _, held in results), [])) == list(range(16))
    assert results[1][1] == list(range(4, 12)), "the test assumes rank 1 holds tokens 4..11"
    for error, _ in results:
        assert error < 1e-12


# ------------------------------------------------------------------ 5. double backward
def run_double_backward(ulysses, ring):
    topo = topology(ulysses, ring)
    q, k, v = (usp.shard_sequence(t.double(), topo).requires_grad_() for t in _inputs(16))

    def second_derivative():
        out = usp.usp_attention(q, k, v, topo, causal=True)
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        torch.autograd.grad(dq.sum(), k)

    return _error_then_usable(topo, second_derivative)


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)])
def test_double_backward_is_refused_on_every_rank(distributed, ulysses, ring):
    results = distributed.run(run_double_backward, ulysses, ring, world_size=2, timeout=TIMEOUT)
    _assert_same_error_everywhere(results, "RuntimeError", "does not support second derivatives")


def test_double_backward_is_refused_in_one_process():
    plan = usp.Plan(None, backend="math")
    q, k, v = (t.double().requires_grad_() for t in _inputs(8))
    out = plan.attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support second derivatives"):
        torch.autograd.grad(dq.sum(), k)


# ------------------------------------------------------------------ 7. smaller items
def test_pad_documents_on_an_empty_tensor_is_explained():
    with pytest.raises(usp.ShardingError, match="at least 2 entries"):
        usp.pad_documents(torch.tensor([], dtype=torch.int32), usp.Plan(None))


def test_cu_seqlens_on_the_meta_device_is_explained():
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device="meta")
    with pytest.raises(usp.ShardingError, match="meta device"):
        usp.Plan(None).pack(cu)
    with pytest.raises(usp.ShardingError, match="meta device"):
        usp.document_position_ids(cu)


def run_length_error():
    topo = topology(1, 2)
    q, k, v = (t[:, :3] for t in _inputs(8))  # 3 local tokens: 6 in all, not a multiple of 4
    try:
        usp.usp_attention(q, k, v, topo, causal=True)
    except usp.ShardingError as err:
        return str(err)
    return "no error"


def test_length_error_names_what_the_caller_passed(distributed):
    for message in distributed.run(run_length_error, world_size=2, timeout=TIMEOUT):
        assert "sequence length 6 must be a multiple of 4" in message
        assert "each of the 2 SP ranks holds 3 tokens" in message


def test_causal_defaults_to_false_everywhere():
    plan = usp.Plan(None, backend="math")
    q, k, v = (t.double() for t in _inputs(8))
    expected, _ = reference_attention(q, k, v, causal=False)
    for out in (
        usp.usp_attention(q, k, v, plan),
        usp.UspAttention(plan)(q, k, v),
        plan.attention(q, k, v),
    ):
        assert relative_error(out, expected) < 1e-12

"""NaN in, NaN out; an infinite key is ignored, not counted; a bad softmax scale is refused.

The contract (``usp/kernels/spec.py``), checked on ``cpu`` and ``math`` here and on
every CUDA backend the build has when a GPU is present:
- a NaN in a query row comes back NaN in that row (and in nothing else);
- a NaN in a key reaches every row that sees that key, and only those;
- a NaN in a value reaches at least every row that sees it;
- a row whose every score in a block is -inf (a key of -inf against a positive query)
  gets lse -inf there, so a merge ignores the block and the finite result is exact;
- merges propagate NaN from either side;
- ``softmax_scale`` NaN, inf, <= 0 or not a number is an AttentionInputError.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CUDA_BACKENDS, require, work_dtype
from reference import reference_attention, relative_error

from usp.kernels import (
    AttentionInputError,
    AttentionSpec,
    attention_backward,
    attention_forward,
    attention_varlen_forward,
    merge_into,
    merge_pair,
)
from usp.kernels.spec import default_scale
from usp.kernels.varlen import PackedDocs, packed_forward

NAN = float("nan")
CPU_BACKENDS = ["cpu", "math"]
# (device, backend): CPU always; CUDA backends only where a GPU is present
ALL = [("cpu", b) for b in CPU_BACKENDS] + [("cuda", b) for b in CUDA_BACKENDS]


def _dtype(device, backend):
    return torch.float32 if device == "cpu" else work_dtype(device, backend)


def _bound(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-2


def _inputs(seqlen_q, seqlen_k, heads=4, kv_heads=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seqlen_q, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, seqlen_k, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, seqlen_k, kv_heads, dim, generator=gen, dtype=torch.float64)
    return q, k, v


def _spec(device, dtype, seqlen_q, seqlen_k, causal, heads=4, kv_heads=2, dim=16):
    return AttentionSpec(
        1, seqlen_q, seqlen_k, heads, kv_heads, dim, dtype, torch.device(device), causal, None
    )


def _assert_finite_rows_match(out, ref, nan_rows, dtype):
    """``nan_rows`` [B, S, H] must be NaN in every element; every other row finite and
    equal to the reference (``reference_attention`` itself returns NaN rows as zeros, so
    only its finite rows are compared)."""
    out = out.double().cpu()
    assert torch.isnan(out[nan_rows]).all(), "NaN did not reach a row that sees it"
    finite = ~nan_rows
    assert torch.isfinite(out[finite]).all(), "NaN reached a row that does not see it"
    assert relative_error(out[finite], ref[finite]) <= _bound(dtype)


# ------------------------------------------------------------------ NaN in, NaN out
@pytest.mark.parametrize("device,backend", ALL)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_nan_query_row_comes_back_nan_in_that_row_only(device, backend, causal):
    dtype = _dtype(device, backend)
    require(backend, _spec(device, dtype, 12, 12, causal))
    q, k, v = _inputs(12, 12)
    q[0, 5, 1, :3] = NAN  # row 5 of query head 1
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    out, lse = attention_forward(
        *(t.to(device, dtype) for t in (q, k, v)), causal=causal, backend=backend
    )
    nan_rows = torch.zeros(1, 12, 4, dtype=torch.bool)
    nan_rows[0, 5, 1] = True
    _assert_finite_rows_match(out, ref_out, nan_rows, dtype)
    assert torch.isnan(lse[0, 1, 5]) or torch.isneginf(lse[0, 1, 5]) or lse[0, 1, 5] == float("inf")
    if device == "cpu":  # exact IEEE semantics on the CPU backends: the LSE is NaN too
        assert torch.isnan(lse[0, 1, 5])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_nan_query_row_that_sees_no_key_stays_empty(backend):
    """Causal with Sq > Sk: row 1 sees nothing, so its NaN reaches nothing (as in the
    float64 reference): out 0, lse -inf."""
    q, k, v = (t.float() for t in _inputs(10, 6))
    q[0, 1, 0, 0] = NAN
    out, lse = attention_forward(q, k, v, causal=True, backend=backend)
    assert (out[0, :4] == 0).all() and torch.isneginf(lse[0, :, :4]).all()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_reaches_the_gradients(backend):
    q, k, v = (t.float() for t in _inputs(12, 12))
    dout = torch.randn_like(q)
    q[0, 5, 1, 0] = NAN
    out, lse = attention_forward(q, k, v, causal=True, backend=backend)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend)
    assert torch.isnan(dq[0, 5, 1]).all()
    assert torch.isnan(dk).any() and torch.isnan(dv).any()


@pytest.mark.parametrize("device,backend", ALL)
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(device, backend):
    dtype = _dtype(device, backend)
    require(backend, _spec(device, dtype, 12, 12, True))
    q, k, v = _inputs(12, 12)
    k[0, 7, 0, 2] = NAN  # key 7 of KV head 0, seen (causal) by rows 7.. of query heads 0, 1
    ref_out, _ = reference_attention(q, k, v, causal=True)
    out, _ = attention_forward(
        *(t.to(device, dtype) for t in (q, k, v)), causal=True, backend=backend
    )
    nan_rows = torch.zeros(1, 12, 4, dtype=torch.bool)
    nan_rows[0, 7:, :2] = True
    _assert_finite_rows_match(out, ref_out, nan_rows, dtype)


@pytest.mark.parametrize("device,backend", ALL)
def test_a_nan_value_reaches_every_row_that_sees_it(device, backend):
    dtype = _dtype(device, backend)
    require(backend, _spec(device, dtype, 12, 12, True))
    q, k, v = _inputs(12, 12)
    v[0, 7, 1, 0] = NAN  # value 7 of KV head 1: query heads 2 and 3, rows 7..
    out, _ = attention_forward(
        *(t.to(device, dtype) for t in (q, k, v)), causal=True, backend=backend
    )
    # rows that do not see it may be NaN too (0 * NaN in P @ V): only the lower bound is asserted
    assert torch.isnan(out[0, 7:, 2:, 0]).all()
    assert torch.isfinite(out[:, :, :2]).all(), "NaN crossed into another KV head's group"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_stays_inside_its_document(backend):
    lens = [5, 9, 7]
    bounds = [0, 5, 14, 21]
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = (t[0].float() for t in _inputs(21, 21, seed=3))
    q[8, 2, 1] = NAN  # a query row of document 1
    k[17, 0, 0] = NAN  # key 3 of document 2 (KV head 0: query heads 0, 1)
    out, lse = attention_varlen_forward(
        q, k, v, cu, cu, max(lens), max(lens), causal=True, backend=backend
    )
    nan_rows = torch.zeros(21, 4, dtype=torch.bool)
    nan_rows[8, 2] = True
    nan_rows[17:21, :2] = True  # rows 3.. of document 2 see key 3
    assert torch.isnan(out[nan_rows]).all()
    assert torch.isfinite(out[~nan_rows]).all()
    for a, b in zip(bounds, bounds[1:]):  # the finite rows are exact, per document
        ref_out, _ = reference_attention(
            q[None, a:b].double(), k[None, a:b].double(), v[None, a:b].double(), causal=True
        )
        finite = ~nan_rows[a:b]
        assert relative_error(out[a:b][finite], ref_out[0][finite]) <= 1e-5


# ------------------------------------------------------------------ infinite keys
def _positive_queries_and_blocks(seqlen_q=8, seqlen_k=6, seed=1):
    """q > 0 everywhere; block A's keys are all -inf (every score -inf), block B finite."""
    q, k_b, v_b = _inputs(seqlen_q, seqlen_k, seed=seed)
    q = q.abs() + 0.1
    k_a = torch.full_like(k_b, float("-inf"))
    v_a = torch.randn_like(v_b)
    return q, (k_a, v_a), (k_b, v_b)


@pytest.mark.parametrize("device,backend", ALL)
def test_a_block_of_infinite_keys_gets_lse_neg_inf_and_the_merge_ignores_it(device, backend):
    """Issue 14, item 4: ``cpu`` returned lse 0 for such a block, and a ring merge then
    counted it (finite outputs off by up to 0.84 at r=2)."""
    dtype = _dtype(device, backend)
    require(backend, _spec(device, dtype, 8, 6, False))
    q, (k_a, v_a), (k_b, v_b) = _positive_queries_and_blocks()
    ref_out, ref_lse = reference_attention(q, k_b, v_b)  # block A contributes exp(-inf) = 0
    on = lambda t: t.to(device, dtype)  # noqa: E731
    out_a, lse_a = attention_forward(on(q), on(k_a), on(v_a), backend=backend)
    assert torch.isneginf(lse_a).all(), f"lse of an all -inf block: {lse_a.flatten()[:4]}"
    out_b, lse_b = attention_forward(on(q), on(k_b), on(v_b), backend=backend)
    out, lse = merge_pair(out_a, lse_a, out_b, lse_b)
    assert relative_error(out.cpu(), ref_out) <= _bound(dtype)
    assert relative_error(lse.cpu(), ref_lse) <= _bound(dtype)
    # the whole sequence in one call gives the same
    whole, _ = attention_forward(
        on(q), on(torch.cat([k_a, k_b], 1)), on(torch.cat([v_a, v_b], 1)), backend=backend
    )
    assert relative_error(whole.cpu(), ref_out) <= _bound(dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_document_of_infinite_keys_gets_lse_neg_inf(backend):
    q, (k_a, v_a), (k_b, v_b) = _positive_queries_and_blocks()
    # two documents: q rows 0..7 against keys of A, q rows 8..15 against keys of B
    q2 = torch.cat([q, q], 1)[0].float()
    k2, v2 = torch.cat([k_a, k_b], 1)[0].float(), torch.cat([v_a, v_b], 1)[0].float()
    docs = PackedDocs.build([0, 8, 16], [0, 6, 12], torch.device("cpu"))
    out, lse = packed_forward(q2, k2, v2, docs, causal=False, backend=backend)
    assert torch.isneginf(lse[:, :8]).all() and (out[:8] == 0).all()
    ref_out, _ = reference_attention(q, k_b, v_b)
    assert relative_error(out[8:], ref_out[0]) <= 1e-5


# ------------------------------------------------------------------ merges
def test_merges_propagate_nan_from_either_side():
    acc_out = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    acc_lse = torch.randn(1, 2, 4, dtype=torch.float64)
    block_out = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    block_lse = torch.randn(1, 2, 4, dtype=torch.float64)
    block_out[0, 1, 0, 3] = NAN  # a NaN output element of row 1, head 0
    block_lse[0, 1, 2] = NAN  # a NaN lse of row 2, head 1
    out, lse = merge_pair(acc_out, acc_lse, block_out, block_lse)
    assert torch.isnan(out[0, 1, 0]).any() and torch.isnan(out[0, 2, 1]).all()
    assert torch.isnan(lse[0, 1, 2])
    others = torch.ones(1, 4, 2, dtype=torch.bool)
    others[0, 1, 0] = others[0, 2, 1] = False
    assert torch.isfinite(out[others]).all()
    # a NaN output behind lse = -inf (how FA-style kernels report a NaN query row) is
    # still NaN after the merge: 0 * NaN, not a silently dropped block
    block_lse = torch.full_like(block_lse, float("-inf"))
    merged = acc_out.clone()
    merged_lse = acc_lse.clone()
    merge_into(merged, merged_lse, block_out, block_lse)
    assert torch.isnan(merged[0, 1, 0, 3]) and torch.equal(merged_lse, acc_lse)


# ------------------------------------------------------------------ softmax scale
@pytest.mark.parametrize(
    "scale", [NAN, float("inf"), float("-inf"), 0.0, -0.125, True, "0.125", torch.tensor(0.125)],
    ids=repr,
)  # fmt: skip
def test_a_bad_softmax_scale_is_refused_before_any_kernel(scale):
    with pytest.raises(AttentionInputError, match="softmax_scale must be a positive finite float"):
        default_scale(64, scale)
    q, k, v = (t.float() for t in _inputs(4, 4))
    with pytest.raises(AttentionInputError, match="softmax_scale"):
        attention_forward(q, k, v, softmax_scale=scale)
    docs = PackedDocs.build([0, 4], [0, 4], torch.device("cpu"))
    with pytest.raises(AttentionInputError, match="softmax_scale"):
        packed_forward(q[0], k[0], v[0], docs, causal=True, softmax_scale=scale)


def test_good_softmax_scales():
    assert default_scale(64, None) == 0.125
    assert default_scale(64, 2) == 2.0 and isinstance(default_scale(64, 2), float)
    assert default_scale(64, 1e-3) == 1e-3

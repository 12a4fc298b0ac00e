"""The CUDA wrappers' conventions and the dispatcher's guarantees, without a GPU where
possible (meta tensors, fake aten ops), and on the GPU when there is one.

Suspected bugs (issue 13) and where each is settled:
- ``efficient`` with causal Sq > Sk: rows that see no key are never given to a kernel
  (the dispatcher cuts them off from the mask geometry, for every backend) — fake op
  here; on the GPU ``test_kernels.py`` (sq>sk, causal) asserts lse -inf / out 0 for
  every backend, and a diagnostic below records what the raw kernel does.
- ``efficient`` backward LSE padding: +inf, as its forward pads — fake op here; the
  GPU test compares with the real forward's padding.
- ``cudnn`` LSE rank: taken from a real forward on the device — fake ops of both ranks
  here; on the GPU the whole forward/backward runs in ``test_kernels.py``.
- host syncs: the dispatch runs on meta tensors (which refuse ``.item()``, ``.tolist()``
  and ``bool()``) with host-to-device tensor construction forbidden; on the GPU under
  ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import CUDA_BACKENDS, require, work_dtype

from usp.kernels import AttentionSpec
from usp.kernels.api import dense_backward, dense_forward
from usp.kernels.backends import registry, sdpa_cuda
from usp.kernels.backends.math import MathBackend
from usp.kernels.varlen import PackedDocs, docs_backward, docs_forward

META = torch.device("meta")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device=META, dtype=dtype)


# ------------------------------------------------------------------ the dispatcher
class RecordingMath(MathBackend):
    """``math`` with a log of the calls it is given, and configurable capabilities."""

    def __init__(self, bottom_right_causal=True, min_seqlen_k=1):
        self.name = "recording"
        self.bottom_right_causal = bottom_right_causal
        self.min_seqlen_k = min_seqlen_k
        self.calls = []

    def forward(self, q, k, v, spec, scale):
        self.calls.append(("forward", spec.seqlen_q, spec.seqlen_k, spec.causal))
        return super().forward(q, k, v, spec, scale)

    def backward(self, dout, q, k, v, out, lse, spec, scale):
        self.calls.append(("backward", spec.seqlen_q, spec.seqlen_k, spec.causal))
        return super().backward(dout, q, k, v, out, lse, spec, scale)


@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom-right", "square-only"])
@pytest.mark.parametrize("seqlens", [(20, 7), (7, 20), (7, 7), (5, 0)], ids=str)
def test_no_kernel_is_given_a_row_that_sees_no_key(bottom_right, seqlens):
    seqlen_q, seqlen_k = seqlens
    impl = RecordingMath(bottom_right_causal=bottom_right)
    spec = AttentionSpec(
        2, seqlen_q, seqlen_k, 4, 2, 8, torch.float64, torch.device("cpu"), True, None
    )
    q = torch.randn(2, seqlen_q, 4, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, seqlen_k, 2, 8, dtype=torch.float64),
        torch.randn(2, seqlen_k, 2, 8, dtype=torch.float64),
    )
    out, lse = dense_forward(impl, q, k, v, spec, 0.3)
    grads = dense_backward(impl, torch.randn_like(q), q, k, v, out, lse, spec, 0.3)
    for _, calls_q, calls_k, causal in impl.calls:
        assert calls_k > 0 and not (causal and calls_q > calls_k)
        if causal and not bottom_right:
            assert calls_q == calls_k, "a square-only backend got a non-square causal call"
    empty = seqlen_q if seqlen_k == 0 else max(0, seqlen_q - seqlen_k)
    assert (out[:, :empty] == 0).all() and torch.isneginf(lse[:, :, :empty]).all()
    assert (grads[0][:, :empty] == 0).all()
    # and the result is exact: math computes the empty rows itself, directly
    ref_out, ref_lse = MathBackend().forward(q, k, v, spec, 0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_calls_with_too_few_keys_go_to_math():
    """cuDNN cannot attend to a single key: the dispatcher sends such kernel calls (the
    one-key full block of a split causal call, a one-key document) to math."""
    impl = RecordingMath(bottom_right_causal=False, min_seqlen_k=2)
    spec = AttentionSpec(1, 6, 7, 2, 2, 8, torch.float64, torch.device("cpu"), True, None)
    q, k = (
        torch.randn(1, 6, 2, 8, dtype=torch.float64),
        torch.randn(1, 7, 2, 8, dtype=torch.float64),
    )
    out, lse = dense_forward(impl, q, k, k, spec, 0.3)
    assert impl.calls == [("forward", 6, 6, True)]  # the 1-key full block ran on math
    ref_out, ref_lse = MathBackend().forward(q, k, k, spec, 0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


# ------------------------------------------------------------------ efficient
def test_efficient_is_never_given_causal_sq_greater_than_sk(monkeypatch):
    """The kernel's bottom-right causal offset is unsigned; Sq > Sk is cut off first."""
    seen = []
    real = torch.ops.aten._efficient_attention_forward

    def recording(q, k, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], args[7]))  # custom_mask_type
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward", recording)
    impl = registry.get("efficient")
    spec = AttentionSpec(2, 70, 40, 8, 2, 64, torch.bfloat16, META, True, None)
    out, lse = dense_forward(
        impl, _meta(2, 70, 8, 64), _meta(2, 40, 2, 64), _meta(2, 40, 2, 64), spec, 0.1
    )
    assert seen == [(40, 40, 2)]
    assert out.shape == (2, 70, 8, 64) and lse.shape == (2, 8, 70)


def test_efficient_backward_pads_the_lse_with_inf_like_its_forward(monkeypatch):
    captured = {}

    def fake_backward(
        dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, logsumexp, *args, **kwargs
    ):
        captured["lse"] = logsumexp
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_backward", fake_backward)
    impl = registry.get("efficient")
    spec = AttentionSpec(1, 40, 40, 4, 4, 64, torch.float32, torch.device("cpu"), True, None)
    lse = torch.randn(1, 4, 40)
    lse[0, 0, 0] = float("-inf")  # a row that saw nothing
    q = torch.randn(1, 40, 4, 64)
    impl.backward(q, q, q, q, q, lse, spec, 0.125)
    kernel_lse = captured["lse"]
    assert kernel_lse.shape == (1, 4, 64) and kernel_lse.is_contiguous()  # ceil(40 / 32) * 32
    assert torch.isposinf(kernel_lse[:, :, 40:]).all(), "padding must be +inf, as the forward's"
    assert kernel_lse[0, 0, 0] == float("inf")  # -inf rows become +inf: exp(s - lse) = 0
    torch.testing.assert_close(kernel_lse[0, 1:, :40], lse[0, 1:])
    # the kernel's own forward pads to the same length (its meta kernel says so)
    forward_lse = torch.ops.aten._efficient_attention_forward(
        _meta(1, 40, 4, 64), _meta(1, 40, 4, 64), _meta(1, 40, 4, 64),
        None, None, None, None, None, 0.0, 2, True, scale=0.1,
    )[1]  # fmt: skip
    assert forward_lse.shape == kernel_lse.shape


# ------------------------------------------------------------------ cuDNN
@pytest.mark.parametrize("rank", [3, 4])
def test_cudnn_backward_gets_the_lse_in_the_rank_a_real_forward_returns(monkeypatch, rank):
    captured = {}

    def fake_forward(q, k, v, bias, compute_lse, dropout, causal, return_mask, scale=None):
        batch, heads, seqlen, _ = q.shape
        lse = torch.randn(batch, heads, seqlen, *((1,) * (rank - 3)))
        return torch.zeros_like(q), lse

    def fake_backward(dout, q, k, v, out, lse, *args, **kwargs):
        captured["lse"] = lse
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fake_forward)
    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", fake_backward
    )
    sdpa_cuda._cudnn_lse_rank.cache_clear()
    try:
        impl = registry.get("cudnn")
        spec = AttentionSpec(2, 16, 16, 4, 4, 64, torch.bfloat16, torch.device("cpu"), True, None)
        q = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)
        out, lse = impl.forward(q, q, q, spec, 0.125)
        assert lse.shape == (2, 4, 16)  # usp's layout, whatever the kernel's
        impl.backward(q, q, q, q, out, lse, spec, 0.125)
        assert captured["lse"].dim() == rank and captured["lse"].is_contiguous()
    finally:
        sdpa_cuda._cudnn_lse_rank.cache_clear()


# ------------------------------------------------------------------ host syncs
@pytest.fixture
def no_host_to_device_tensors(monkeypatch):
    """Building a tensor from Python data inside a call is a host-to-device copy on a GPU."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was built from host data inside a kernel call")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "math"])
@pytest.mark.parametrize("seqlens", [(40, 40), (24, 56), (56, 24)], ids=str)
def test_dense_dispatch_has_no_host_sync(backend, seqlens, no_host_to_device_tensors):
    """Meta tensors have no data: any .item(), .tolist() or bool(tensor) raises."""
    impl = registry.get(backend)
    sdpa_cuda._cudnn_lse_rank(META)  # the one-time probe runs before, as in a warm process
    seqlen_q, seqlen_k = seqlens
    spec = AttentionSpec(2, seqlen_q, seqlen_k, 8, 2, 64, torch.bfloat16, META, True, None)
    q, k = _meta(2, seqlen_q, 8, 64), _meta(2, seqlen_k, 2, 64)
    out, lse = dense_forward(impl, q, k, k, spec, 0.1)
    assert out.shape == q.shape and lse.shape == (2, 8, seqlen_q)
    if backend == "efficient":
        return  # torch's meta function for its backward lacks the schema's `out` argument
    grads = dense_backward(impl, torch.empty_like(q), q, k, k, out, lse, spec, 0.1)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


@pytest.mark.parametrize("backend", ["flash", "cudnn", "math"])
def test_packed_dispatch_has_no_host_sync(backend, monkeypatch):
    """Native varlen (flash) and the per-document loop (others): with ``PackedDocs``
    built once per batch, a call reads no device value and copies nothing host-to-device."""
    docs = PackedDocs.build([0, 10, 10, 40, 52], [0, 14, 14, 40, 49], META)
    impl = registry.get(backend)
    sdpa_cuda._cudnn_lse_rank(META)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was built from host data inside a kernel call")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    spec = AttentionSpec(1, 52, 49, 8, 2, 64, torch.bfloat16, META, True, None, varlen=True)
    q, k = _meta(52, 8, 64), _meta(49, 2, 64)
    out, lse = docs_forward(impl, q, k, k, docs, spec, 0.1)
    assert out.shape == q.shape and lse.shape == (8, 52)
    grads = docs_backward(impl, torch.empty_like(q), q, k, k, out, lse, docs, spec, 0.1)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


# ------------------------------------------------------------------ on the GPU
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_no_host_sync_on_the_gpu(backend):
    device = torch.device("cuda")
    dtype = work_dtype("cuda", backend)
    spec = AttentionSpec(2, 64, 96, 8, 2, 64, dtype, device, True, None)
    require(backend, spec)  # self-checks run here, before sync detection is switched on
    require(backend, dataclasses.replace(spec, varlen=True))
    impl = registry.get(backend)
    docs = PackedDocs.build([0, 20, 20, 64], [0, 30, 30, 96], device)
    q = torch.randn(2, 96, 8, 64, device=device, dtype=dtype)
    k = torch.randn(2, 96, 2, 64, device=device, dtype=dtype)
    out, lse = dense_forward(impl, q[:, :64], k, k, spec, 0.1)  # warm-up, incl. the
    dense_backward(impl, out, q[:, :64], k, k, out, lse, spec, 0.1)  # cuDNN LSE-rank probe
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for seqlen_q, seqlen_k in ((64, 96), (96, 64), (64, 64)):  # Sq < Sk, Sq > Sk, square
            s = dataclasses.replace(spec, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
            qs, ks = q[:, :seqlen_q], k[:, :seqlen_k]
            out, lse = dense_forward(impl, qs, ks, ks, s, 0.1)
            dense_backward(impl, out, qs, ks, ks, out, lse, s, 0.1)
        packed = dataclasses.replace(spec, batch=1, varlen=True)
        qp, kp = q[0, :64], k[0]
        out, lse = docs_forward(impl, qp, kp, kp, docs, packed, 0.1)
        docs_backward(impl, out, qp, kp, kp, out, lse, docs, packed, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@needs_cuda
def test_efficient_forward_pads_its_lse_with_inf_on_the_gpu():
    require(
        "efficient",
        AttentionSpec(1, 40, 40, 4, 4, 64, torch.bfloat16, torch.device("cuda"), True, None),
    )
    q = torch.randn(1, 40, 4, 64, device="cuda", dtype=torch.bfloat16)
    lse = torch.ops.aten._efficient_attention_forward(
        q, q, q, None, None, None, None, None, 0.0, 2, True, scale=0.1
    )[1]
    assert lse.shape == (1, 4, 64)
    assert torch.equal(sdpa_cuda.efficient_kernel_lse(lse[:, :, :40]), lse)


@needs_cuda
@pytest.mark.xfail(
    strict=False,
    reason="diagnostic: what the raw kernel does for causal Sq > Sk (usp never sends it)",
)
def test_diagnostic_raw_efficient_kernel_with_causal_sq_greater_than_sk():
    """XPASS: the kernel is right for Sq > Sk bottom-right; XFAIL: it is not (as its
    unsigned causal offset suggests). Either way usp is unaffected; this records which."""
    q = torch.randn(1, 80, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 48, 4, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = torch.ops.aten._efficient_attention_forward(
        q, k, k, None, None, None, None, None, 0.0, 2, True, scale=0.125
    )[:2]
    spec = AttentionSpec(1, 80, 48, 4, 4, 64, torch.float32, torch.device("cuda"), True, None)
    ref_out, ref_lse = MathBackend().forward(q.float(), k.float(), k.float(), spec, 0.125)
    assert torch.isneginf(lse[:, :, :32]).all(), f"rows seeing no key: lse {lse[0, 0, :4].tolist()}"
    torch.testing.assert_close(out[:, 32:].float(), ref_out[:, 32:], atol=3e-2, rtol=0)
    torch.testing.assert_close(lse[:, :, 32:80], ref_lse[:, :, 32:], atol=3e-2, rtol=0)


@needs_cuda
@pytest.mark.xfail(
    strict=False,
    reason="diagnostic: torch's meta kernel and the CUDA kernel may disagree on the LSE rank",
)
def test_diagnostic_cudnn_lse_rank_meta_against_real():
    sdpa_cuda._cudnn_lse_rank.cache_clear()
    assert sdpa_cuda._cudnn_lse_rank(META) == sdpa_cuda._cudnn_lse_rank(torch.device("cuda", 0))


def test_efficient_repeats_kv_heads_per_query_group_and_sums_them_back():
    spec = AttentionSpec(2, 5, 5, 6, 3, 4, torch.float32, torch.device("cpu"), False, None)
    kv = torch.randn(2, 5, 3, 4)
    repeated = sdpa_cuda._repeat_kv(kv, spec)
    assert torch.equal(repeated, kv.repeat_interleave(2, dim=2))  # query head h uses KV h // 2
    torch.testing.assert_close(sdpa_cuda._sum_kv_groups(repeated, spec), 2 * kv)


def test_packed_docs_reuse_boundaries_already_on_the_device():
    """attention_varlen_forward's cu_seqlens are usually on the device already: reused,
    not copied again; anything else (another dtype, a host tensor) is copied once."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    docs = PackedDocs.build([0, 3, 7], [0, 3, 7], torch.device("cpu"), cu_q=cu, cu_k=cu.long())
    assert docs.cu_q is cu
    assert docs.cu_k is not cu and docs.cu_k.dtype == torch.int32
    assert docs.cu_k.tolist() == [0, 3, 7] and (docs.max_q, docs.max_k) == (4, 4)

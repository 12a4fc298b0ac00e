"""Local attention kernels against an independent float64 reference, every backend the
build has.

Which backends: on CPU ``cpu`` and ``math``; on CUDA ``cudnn``, ``flash``, ``efficient``
and ``math``, plus ``flash_attn`` when the package is installed
(``registry.expected_backends``). A test skips a backend only for a limit it states
(a dtype, a head dim, no window); a backend that refuses a call it should serve (it
failed its self-check, its kernel is missing from the build) FAILS the test.

Tolerances are relative to the largest reference magnitude (``relative_error``):
CPU float32 5e-6 for out/lse and 1e-5 for gradients; bfloat16 2e-2 for out, 5e-3 for lse
(computed in float32 from bf16 inputs) and 4e-2 for gradients. Measured worst cases on
the CPU backends: float32 8e-7 / 3e-7 / 1.3e-6, bfloat16 6.4e-3 / 1.7e-3 / 1.2e-2;
the bounds are a few times those, so a missing mask element or a wrong LSE fails them.
CUDA float32 bounds are 10x the CPU ones (the kernels' fast exp2/log and split-TF32
matmuls; a missing mask element still costs ~1e-2): not yet measured on a GPU.
Head dim 128 runs with a softmax scale that is not head_dim**-0.5, so a kernel that
drops ``softmax_scale`` fails.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kernel_cases import BACKENDS, require, work_dtype
from reference import reference_attention, relative_error

from usp.kernels import (
    AttentionInputError,
    AttentionSpec,
    BackendUnavailableError,
    attention_backward,
    attention_forward,
    attention_varlen_backward,
    attention_varlen_forward,
    merge_pair,
    packed_backward,
    packed_forward,
)
from usp.kernels.backends import registry
from usp.kernels.docs import PackedDocs
from usp.kernels.selection import unsupported_reason

TOLERANCE = {  # (device type, dtype): (out, lse, grads)
    ("cpu", torch.float32): (5e-6, 5e-6, 1e-5),
    ("cpu", torch.bfloat16): (2e-2, 5e-3, 4e-2),
    ("cpu", torch.float64): (1e-12, 1e-12, 1e-12),
    ("cuda", torch.float32): (5e-5, 5e-5, 1e-4),
    ("cuda", torch.bfloat16): (2e-2, 5e-3, 4e-2),
    ("cuda", torch.float64): (1e-12, 1e-12, 1e-12),
}
# head dim 128 runs at ~1.25x the default scale (a dropped scale= changes the logits by 20%)
SCALE = {64: None, 128: 0.11}


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fresh allocations come back full of NaN, so an element a kernel forgets to
    write shows up as NaN instead of a lucky zero."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype not in (torch.bool,):
            t.fill_(-(2**30) if t.dtype in (torch.int32, torch.int64) else 0)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    if torch.cuda.is_available():  # the caching allocator hands this memory out next
        torch.cuda.empty_cache()
        junk = real_empty(256 * 2**20, device="cuda").fill_(float("nan"))
        del junk


def _inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _reference(q, k, v, dout, **options):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(q, k, v, **options)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), (dq, dk, dv)


def _check(name, actual, expected, bound):
    err = relative_error(actual.cpu(), expected)
    assert err <= bound, f"{name}: relative error {err:.3g} > {bound:.1g}"


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlens", [(37, 37), (19, 45), (45, 19)], ids=["sq=sk", "sq<sk", "sq>sk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_backend_matches_reference(
    poisoned_allocations, device, backend, dtype, head_dim, seqlens, causal, heads
):
    if backend == "math" and dtype == torch.bfloat16 and head_dim == 128:
        pytest.skip("math is the reference; one bf16 head dim is enough")
    (seqlen_q, seqlen_k), (num_heads, kv_heads) = seqlens, heads
    spec = AttentionSpec(
        2,
        seqlen_q,
        seqlen_k,
        num_heads,
        kv_heads,
        head_dim,
        dtype,
        torch.device(device),
        causal,
        None,
    )
    require(backend, spec)
    scale = SCALE[head_dim]
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k, num_heads, kv_heads, head_dim, dtype, device)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, causal=causal, scale=scale)
    cast = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]

    out, lse = attention_forward(*cast[:3], causal=causal, softmax_scale=scale, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, num_heads, seqlen_q)
    out_tol, lse_tol, grad_tol = TOLERANCE[device, dtype]
    _check("out", out, ref_out, out_tol)
    _check("lse", lse, ref_lse, lse_tol)
    if seqlen_q > seqlen_k and causal:  # rows with no visible key
        assert torch.isneginf(lse[:, :, : seqlen_q - seqlen_k]).all()
        assert (out[:, : seqlen_q - seqlen_k] == 0).all()

    # the backward takes an external out/lse: give it the reference's, cast like a ring would
    grads = attention_backward(
        cast[3],
        *cast[:3],
        ref_out.to(device=device, dtype=dtype),
        ref_lse.to(device=device, dtype=torch.float32),
        causal=causal,
        softmax_scale=scale,
        backend=backend,
    )
    for name, grad, ref, x in zip(("dq", "dk", "dv"), grads, ref_grads, cast[:3]):
        assert grad.dtype == dtype and grad.shape == x.shape, name
        _check(name, grad, ref, grad_tol)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_float64_is_exact_where_supported(device, backend):
    q, k, v, dout = _inputs(1, 21, 33, 6, 3, 32, torch.float64, device)
    spec = AttentionSpec(1, 21, 33, 6, 3, 32, torch.float64, torch.device(device), True, None)
    require(backend, spec)
    q, k, v, dout = (t.to(device) for t in (q, k, v, dout))
    ref_out, ref_lse, ref_grads = _reference(*(t.cpu() for t in (q, k, v, dout)), causal=True)
    out, lse = attention_forward(q, k, v, causal=True, backend=backend)
    assert lse.dtype == torch.float64
    _check("out", out, ref_out, 1e-12)
    _check("lse", lse, ref_lse, 1e-12)
    ref_out, ref_lse = ref_out.to(device), ref_lse.to(device)
    for grad, ref in zip(
        attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True, backend=backend), ref_grads
    ):
        _check("grad", grad, ref, 1e-12)


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_with_an_externally_merged_result(device, backend, causal):
    """What the ring does: attend to two key blocks separately, merge by LSE, then run
    each block's backward with the merged out/lse; the sum is the full gradient."""
    dtype = work_dtype(device, backend)
    out_tol, lse_tol, grad_tol = (
        (1e-5, 1e-5, 2e-5) if dtype == torch.float32 else TOLERANCE[device, dtype]
    )
    spec = AttentionSpec(2, 12, 12, 4, 2, 64, dtype, torch.device(device), causal, None)
    require(backend, spec)
    q, k, v, dout = _inputs(2, 24, 24, 4, 2, 64, torch.float32, device, seed=3)
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = _reference(q, k, v, dout, causal=causal)
    q, k, v, dout = (t.to(device=device, dtype=dtype) for t in (q, k, v, dout))
    # keys [0, 12) are fully visible to queries [12, 24); keys [12, 24) form the diagonal block
    q_hi, k_lo, v_lo, k_hi, v_hi = q[:, 12:], k[:, :12], v[:, :12], k[:, 12:], v[:, 12:]
    out_a, lse_a = attention_forward(q_hi, k_lo, v_lo, backend=backend)
    out_b, lse_b = attention_forward(q_hi, k_hi, v_hi, causal=causal, backend=backend)
    out, lse = merge_pair(out_a, lse_a, out_b, lse_b)
    _check("merged out", out, ref_out[:, 12:], out_tol)
    _check("merged lse", lse, ref_lse[:, :, 12:], lse_tol)
    out = out.to(q.dtype)
    dq_a, dk_a, dv_a = attention_backward(dout[:, 12:], q_hi, k_lo, v_lo, out, lse, backend=backend)
    dq_b, dk_b, dv_b = attention_backward(
        dout[:, 12:], q_hi, k_hi, v_hi, out, lse, causal=causal, backend=backend
    )
    if causal:  # queries [12, 24) are the only ones that see keys [12, 24)
        _check("dk (diagonal)", dk_b, ref_dk[:, 12:], grad_tol)
        _check("dv (diagonal)", dv_b, ref_dv[:, 12:], grad_tol)
    _check(
        "dq",
        dq_a.float() + dq_b.float(),
        _reference(
            q.double().cpu()[:, 12:],
            k.double().cpu(),
            v.double().cpu(),
            dout.double().cpu()[:, 12:],
            causal=causal,
        )[2][0],
        grad_tol,
    )


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("seqlens", [(30, 30), (17, 40), (40, 17)], ids=["sq=sk", "sq<sk", "sq>sk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sliding_window(poisoned_allocations, device, backend, seqlens, causal):
    seqlen_q, seqlen_k = seqlens
    window = 7
    dtype = work_dtype(device, backend)
    out_tol, lse_tol, grad_tol = (
        (1e-5, 1e-5, 2e-5) if dtype == torch.float32 else TOLERANCE[device, dtype]
    )
    spec = AttentionSpec(
        2, seqlen_q, seqlen_k, 4, 2, 64, dtype, torch.device(device), causal, window
    )
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k, 4, 2, 64, dtype, device, seed=5)
    cast = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]
    if not registry.get(backend).supports_window:
        with pytest.raises(BackendUnavailableError, match="sliding-window"):
            attention_forward(*cast[:3], causal=causal, window=window, backend=backend)
        return
    require(backend, spec)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, causal=causal, window=window)
    out, lse = attention_forward(*cast[:3], causal=causal, window=window, backend=backend)
    _check("out", out, ref_out, out_tol)
    _check("lse", lse, ref_lse, lse_tol)
    grads = attention_backward(
        cast[3],
        *cast[:3],
        ref_out.to(device=device, dtype=dtype),
        ref_lse.float().to(device),
        causal=causal,
        window=window,
        backend=backend,
    )
    for grad, ref in zip(grads, ref_grads):
        _check("grad", grad, ref, grad_tol)


# documents of lengths 1, 13, 0 (empty), 29, 6, 9; keys longer than queries in two of
# them, fewer keys than queries in the last (its first 5 rows see nothing when causal)
DOCS_Q = [1, 13, 0, 29, 6, 9]
DOCS_K = [1, 20, 0, 29, 11, 4]
# documents of repeated (q, k) lengths, which the CPU runs as batched calls: a contiguous
# run (5, 5) x 3, an interleaved group (3, 6) x 3, a group whose causal rows partly see
# no key (6, 2) x 2, a single (7, 7) and a document without queries
GROUPED_Q = [5, 5, 5, 3, 6, 7, 3, 0, 6, 3]
GROUPED_K = [5, 5, 5, 6, 2, 7, 6, 4, 2, 6]


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_reference(q, k, v, dout, lens_q, lens_k, **options):
    """Per-document float64 reference of a packed call: out, lse [H, Tq], (dq, dk, dv)."""
    ref_out = torch.zeros_like(q)
    ref_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    ref_dq, ref_dk, ref_dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bounds_q, bounds_k = cumulative(lens_q).tolist(), cumulative(lens_k).tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if q1 == q0:
            continue
        o, lse_doc, g = _reference(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], **options
        )
        ref_out[q0:q1], ref_lse[:, q0:q1] = o[0], lse_doc[0]
        ref_dq[q0:q1], ref_dk[k0:k1], ref_dv[k0:k1] = (x[0] for x in g)
    return ref_out, ref_lse, (ref_dq, ref_dk, ref_dv)


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "docs_q,docs_k", [(DOCS_Q, DOCS_K), (GROUPED_Q, GROUPED_K)], ids=["distinct", "grouped"]
)
def test_varlen_matches_per_document_reference(
    poisoned_allocations, device, backend, causal, dtype, docs_q, docs_k
):
    spec = AttentionSpec(
        1,
        sum(docs_q),
        sum(docs_k),
        4,
        2,
        64,
        dtype,
        torch.device(device),
        causal,
        None,
        varlen=True,
    )
    require(backend, spec)
    cu_q, cu_k = cumulative(docs_q), cumulative(docs_k)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(docs_q), 4, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(docs_k), 2, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(docs_k), 2, 64, generator=gen, dtype=torch.float64)
    dout = torch.randn_like(q)
    ref_out, ref_lse, ref_grads = packed_reference(q, k, v, dout, docs_q, docs_k, causal=causal)
    on = lambda t: t.to(device)  # noqa: E731
    cast = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]
    out, lse = attention_varlen_forward(
        *cast[:3], on(cu_q), on(cu_k), max(docs_q), max(docs_k), causal=causal, backend=backend
    )
    out_tol, lse_tol, grad_tol = TOLERANCE[device, dtype]
    assert lse.shape == (4, q.shape[0])
    _check("out", out, ref_out, out_tol)
    _check("lse", lse, ref_lse, lse_tol)
    grads = attention_varlen_backward(
        cast[3],
        *cast[:3],
        ref_out.to(device=device, dtype=dtype),
        ref_lse.float().to(device),
        on(cu_q),
        on(cu_k),
        max(docs_q),
        max(docs_k),
        causal=causal,
        backend=backend,
    )
    for grad, ref in zip(grads, ref_grads):
        _check("grad", grad, ref, grad_tol)


@pytest.mark.parametrize("device,backend", [(d, b) for d, b in BACKENDS if b != "math"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_backend_the_build_has_passes_its_self_check(device, backend, dtype, head_dim):
    """Dense and (for backends with varlen kernels) packed; see ``selfcheck.py`` for what
    it covers. ``math`` is the reference the check compares against."""
    spec = AttentionSpec(1, 64, 64, 4, 2, head_dim, dtype, torch.device(device), True, None)
    require(backend, spec)
    require(backend, dataclasses.replace(spec, varlen=True))
    assert unsupported_reason(registry.get(backend), spec) is None


def test_auto_picks_the_first_supported_backend_in_preference_order():
    cpu_spec = AttentionSpec(1, 8, 8, 2, 2, 64, torch.float32, torch.device("cpu"), True, None)
    assert registry.auto_order(torch.device("cpu"))[0] == "cpu"
    from usp.kernels import select_backend

    assert select_backend(cpu_spec).name == "cpu"
    varlen_spec = dataclasses.replace(cpu_spec, varlen=True)
    assert select_backend(varlen_spec).name == "cpu"  # no native varlen on CPU: per-document loop
    cuda_order = registry.auto_order(torch.device("cuda"))
    assert (
        cuda_order.index("cudnn")
        < cuda_order.index("flash")
        < cuda_order.index("efficient")
        < cuda_order.index("math")
    )


# ------------------------------------------------------------------ bad input
def _good(**over):
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    v = torch.randn(1, 8, 2, 16)
    tensors = {"q": q, "k": k, "v": v}
    tensors.update(over)
    return tensors["q"], tensors["k"], tensors["v"]


@pytest.mark.parametrize(
    "tensors,message",
    [
        (
            _good(q=torch.randn(8, 4, 16)),
            r"q must be 4-D \[batch, seq, heads, head_dim\], got shape \(8, 4, 16\)",
        ),
        (
            _good(k=torch.randn(1, 8, 2, 32), v=torch.randn(1, 8, 2, 32)),
            "same head_dim, got 16 and 32",
        ),
        (
            _good(k=torch.randn(1, 8, 3, 16), v=torch.randn(1, 8, 3, 16)),
            r"query heads \(4\) must be a multiple of the number of key/value heads \(3\)",
        ),
        (_good(v=torch.randn(1, 8, 2, 16, dtype=torch.float64)), "share a dtype"),
        (_good(v=torch.randn(1, 9, 2, 16)), "k and v must have the same shape"),
        (
            _good(k=torch.randn(2, 8, 2, 16), v=torch.randn(2, 8, 2, 16)),
            "same batch size, got 1 and 2",
        ),
        (_good(q=torch.ones(1, 8, 4, 16, dtype=torch.int64)), "floating-point"),
    ],
)
def test_bad_inputs_are_explained(tensors, message):
    with pytest.raises(AttentionInputError, match=message):
        attention_forward(*tensors)


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(
        AttentionInputError, match="unknown attention backend 'fast'; valid: auto, cudnn"
    ):
        attention_forward(*_good(), backend="fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_a_cuda_backend_on_cpu_tensors_says_which_backends_can(backend):
    with pytest.raises(
        BackendUnavailableError,
        match=rf"'{backend}' cannot run .*runs on cuda, not cpu.*Backends that can: cpu, math",
    ):
        attention_forward(*_good(), backend=backend)


def test_flash_attn_package_missing_is_explained():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="needs the flash_attn package"):
            attention_forward(*_good(), backend="flash_attn")
    else:
        pytest.skip("flash-attn is installed")


def test_bad_options_and_backward_inputs():
    q, k, v = _good()
    with pytest.raises(AttentionInputError, match="window must be None or an int >= 0"):
        attention_forward(q, k, v, window=-1)
    with pytest.raises(AttentionInputError, match="causal must be a bool"):
        attention_forward(q, k, v, causal=1)
    with pytest.raises(AttentionInputError, match="softmax_scale must be a positive finite float"):
        attention_forward(q, k, v, softmax_scale=0.0)
    out, lse = attention_forward(q, k, v)
    with pytest.raises(
        AttentionInputError, match=r"lse must be \[batch, heads, seq\] = \(1, 4, 8\)"
    ):
        attention_backward(out, q, k, v, out, lse.transpose(1, 2))
    with pytest.raises(AttentionInputError, match="lse must be torch.float32"):
        attention_backward(out, q, k, v, out, lse.half())
    with pytest.raises(AttentionInputError, match="dout must have q's shape"):
        attention_backward(out[:, :4], q, k, v, out, lse)


@pytest.mark.parametrize(
    "cu,message",
    [
        ([0, 4, 3, 8], r"non-decreasing, but entry 2 \(3\) < entry 1 \(4\)"),
        ([1, 4, 8], "must start at 0, got 1"),
        ([0, 4, 7], r"must end at the number of tokens \(8\), got 7"),
    ],
)
def test_bad_cu_seqlens_are_explained(cu, message):
    q, k, v = (t[0] for t in _good())
    cu = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(AttentionInputError, match=message):
        attention_varlen_forward(q, k, v, cu, cu)
    with pytest.raises(AttentionInputError, match="must have dtype torch.int32, got torch.int64"):
        attention_varlen_forward(q, k, v, cu.long(), cu.long())


def test_merge_of_blocks_that_see_nothing_stays_finite():
    out = torch.zeros(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    merged_out, merged_lse = merge_pair(out, lse, out, lse)
    assert torch.isneginf(merged_lse).all() and (merged_out == 0).all()
    assert math.isclose(
        merge_pair(out + 1, torch.zeros(1, 2, 3), out, lse)[0][0, 0, 0, 0].item(), 1.0
    )


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_backends_without_windows_say_so(backend):
    # a CUDA spec is only inspected here, so this runs without a GPU
    spec = AttentionSpec(1, 64, 64, 4, 2, 64, torch.bfloat16, torch.device("cuda"), True, 16)
    assert unsupported_reason(registry.get(backend), spec) == "has no sliding-window support"
    assert unsupported_reason(registry.get("math"), spec) is None


# ------------------------------------------------------------------ CUDA plumbing without a GPU
META = torch.device("meta")


def _meta(*shape):
    return torch.empty(*shape, device=META, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("seqlens,causal", [((40, 40), True), ((40, 56), False), ((40, 56), True)])
def test_cuda_backends_call_their_ops_correctly_on_meta_tensors(backend, seqlens, causal):
    """The aten ops' meta implementations check op names, arity, argument order and
    types, and give the output shapes, so the CUDA wrappers' plumbing is tested here
    without a GPU (numerics need one: benchmarks/gpu_check.sh)."""
    impl = registry.get(backend)
    (seqlen_q, seqlen_k), batch, heads, kv_heads, dim = seqlens, 2, 8, 2, 64
    if causal and seqlen_q != seqlen_k and not impl.bottom_right_causal:
        pytest.skip("the dispatcher splits non-square causal calls for this backend")
    spec = AttentionSpec(
        batch, seqlen_q, seqlen_k, heads, kv_heads, dim, torch.bfloat16, META, causal, None
    )
    q, k, v = (
        _meta(batch, seqlen_q, heads, dim),
        _meta(batch, seqlen_k, kv_heads, dim),
        _meta(batch, seqlen_k, kv_heads, dim),
    )
    out, lse = impl.forward(q, k, v, spec, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32
    if backend == "efficient":
        pytest.skip(
            "torch's meta function for _efficient_attention_backward lacks the schema's `out` argument"
        )
    grads = impl.backward(torch.empty_like(q), q, k, v, out, lse, spec, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == torch.bfloat16 for g in grads)


def test_flash_window_and_varlen_calls_on_meta_tensors():
    impl = registry.get("flash")
    q, k = _meta(2, 40, 8, 64), _meta(2, 40, 2, 64)
    spec = AttentionSpec(2, 40, 40, 8, 2, 64, torch.bfloat16, META, True, 8)
    out, lse = impl.forward(q, k, k, spec, 0.125)
    assert [g.shape for g in impl.backward(q, q, k, k, out, lse, spec, 0.125)] == [
        q.shape,
        k.shape,
        k.shape,
    ]
    tokens, cu = 50, torch.tensor([0, 20, 50], dtype=torch.int32, device=META)
    qv, kv = _meta(tokens, 8, 64), _meta(tokens, 2, 64)
    spec = AttentionSpec(1, tokens, tokens, 8, 2, 64, torch.bfloat16, META, True, None, varlen=True)
    out, lse = impl.varlen_forward(qv, kv, kv, cu, cu, 30, 30, spec, 0.125)
    assert out.shape == qv.shape and lse.shape == (8, tokens)
    grads = impl.varlen_backward(qv, qv, kv, kv, out, lse, cu, cu, 30, 30, spec, 0.125)
    assert [g.shape for g in grads] == [qv.shape, kv.shape, kv.shape]


def test_a_batchs_per_document_calls_are_built_once_and_reused():
    """Backends without a varlen kernel keep what they work out from the boundaries in
    the PackedDocs (one batch serves every layer, forward and backward): the second
    call and the backward reuse it, and the results are the ones a fresh one gives."""
    bounds = cumulative(GROUPED_Q).tolist()
    docs = PackedDocs.build(bounds, bounds, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(bounds[-1], 4, 16, generator=gen)
    k, v = (torch.randn(bounds[-1], 2, 16, generator=gen) for _ in range(2))
    out, lse = packed_forward(q, k, v, docs, causal=True, backend="cpu")
    assert len(docs.per_document) == 1
    (calls,) = docs.per_document.values()
    again, _ = packed_forward(q, k, v, docs, causal=True, backend="cpu")
    grads = packed_backward(
        torch.ones_like(out), q, k, v, out, lse, docs, causal=True, backend="cpu"
    )
    assert list(docs.per_document.values()) == [calls]  # the same object, nothing rebuilt
    fresh = PackedDocs.build(bounds, bounds, torch.device("cpu"))
    assert torch.equal(again, out)
    assert torch.equal(packed_forward(q, k, v, fresh, causal=True, backend="cpu")[0], out)
    fresh_grads = packed_backward(
        torch.ones_like(out), q, k, v, out, lse, fresh, causal=True, backend="cpu"
    )
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh_grads))
    packed_forward(q, k, v, docs, causal=False, backend="cpu")  # another call shape
    assert len(docs.per_document) == 2

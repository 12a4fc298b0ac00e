"""The run-time self-check catches broken kernels, and flash-attn falls back FA3 -> FA2.

Runs on CPU: the self-check is generic (it vets ``cpu`` on CPU as it vets the CUDA
backends on a GPU), so a deliberately broken backend (a dropped ``softmax_scale``) is
shown to fail it here, to make ``auto`` warn and move on, to make a named backend
raise, and (tests/kernels/test_kernels_gpu_check.py) to make the kernel benchmark fail. The
flash-attn generations are fakes with the package's calling conventions, computing with
``math``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from usp.kernels import (
    AttentionSpec,
    BackendUnavailableError,
    attention_forward,
    selection,
    selfcheck,
)
from usp.kernels.backends import flash_attn, registry
from usp.kernels.backends.base import Backend, BackendFailure
from usp.kernels.backends.cpu import CpuBackend
from usp.kernels.backends.flash_attn import FlashAttnApi, choose_variant

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Each test starts with no cached verdicts and no remembered auto reports."""
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selection, "_reported_skips", set())


def _drop_the_scale(monkeypatch):
    """Break ``cpu`` the way a wrapper bug would: call the kernel without ``scale=``
    (so it uses head_dim**-0.5)."""
    real_forward = CpuBackend.forward

    def forward(self, q, k, v, spec, scale):
        return real_forward(self, q, k, v, spec, spec.head_dim**-0.5)

    monkeypatch.setattr(CpuBackend, "forward", forward)


# ------------------------------------------------------------------ what it covers
class Recording(Backend):
    """``cpu`` with a log of what the kernels were given."""

    name = "recording"
    device_types = ("cpu",)
    supports_window = True

    def __init__(self):
        self.calls = []
        self.inner = CpuBackend()

    def forward(self, q, k, v, spec, scale):
        self.calls.append(
            {
                "batch": q.shape[0],
                "head_dim": q.shape[-1],
                "strided": not q.is_contiguous(),
                "scale": scale,
                "gqa": q.shape[2] != k.shape[2],
                "autocast": torch.is_autocast_enabled("cpu"),
                "window": spec.window,
                "causal": spec.causal,
                "square": spec.seqlen_q == spec.seqlen_k,
            }
        )
        return self.inner.forward(q, k, v, spec, scale)

    def backward(self, *args):
        return self.inner.backward(*args)


def test_the_self_check_covers_what_a_weaker_one_missed():
    impl = Recording()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's context: switched off inside
        assert selfcheck.self_check(impl, CPU, torch.float32, 128) is None
    calls = impl.calls
    assert {c["batch"] for c in calls} == {2}
    assert {c["head_dim"] for c in calls} == {128}
    assert all(c["strided"] for c in calls), "q should reach the kernel as a strided view"
    assert {c["scale"] for c in calls} == {selfcheck.SCALE_FACTOR * 128**-0.5}
    assert selfcheck.SCALE_FACTOR != 1.0
    assert all(c["gqa"] for c in calls)
    assert not any(c["autocast"] for c in calls)
    # causal square blocks, and full Sq != Sk blocks (cpu gets causal Sq < Sk split into those)
    assert {(c["causal"], c["square"]) for c in calls} == {(True, True), (False, False)}
    assert {c["window"] for c in calls} == {None, 16, 8}
    # rows that see no key (causal, Sq > Sk) are part of it (the dispatcher cuts them off
    # before the kernel, so they do not show up in the kernel's log)
    assert any(sq > sk and causal for sq, sk, causal, _ in selfcheck._DENSE_CASES)


def test_a_dropped_scale_fails_the_self_check(monkeypatch):
    assert selfcheck.self_check(CpuBackend(), CPU, torch.float32, 64) is None
    _drop_the_scale(monkeypatch)
    selfcheck.clear_cache()
    verdict = selfcheck.self_check(CpuBackend(), CPU, torch.float32, 64)
    assert isinstance(verdict, BackendFailure) and not verdict.transient
    assert "failed its self-check on cpu, torch.float32, head_dim=64" in verdict
    assert "off by" in verdict and "scale=0.075" in verdict


def test_a_broken_backend_is_skipped_loudly_by_auto_and_refused_by_name(monkeypatch):
    _drop_the_scale(monkeypatch)
    q, k, v = torch.randn(1, 16, 4, 32), torch.randn(1, 16, 2, 32), torch.randn(1, 16, 2, 32)
    with pytest.warns(RuntimeWarning, match="'cpu' skipped by auto: it failed its self-check"):
        out, _ = attention_forward(q, k, v, causal=True)  # runs on math, correctly
    expected, _ = attention_forward(q, k, v, causal=True, backend="math")
    torch.testing.assert_close(out, expected)
    with pytest.raises(BackendUnavailableError, match="'cpu' cannot run .* failed its self-check"):
        attention_forward(q, k, v, causal=True, backend="cpu")


def test_verdicts_are_cached_per_device_dtype_and_head_dim():
    impl = Recording()
    assert selfcheck.self_check(impl, CPU, torch.float32, 64) is None
    runs = len(impl.calls)
    assert selfcheck.self_check(impl, CPU, torch.float32, 64) is None
    assert len(impl.calls) == runs  # cached
    selfcheck.self_check(impl, CPU, torch.float32, 128)
    selfcheck.self_check(impl, CPU, torch.bfloat16, 64)
    assert len(impl.calls) == 3 * runs  # a new head dim and a new dtype each check again


class Failing(Backend):
    name = "failing"
    device_types = ("cpu",)

    def __init__(self, error):
        self.error = error
        self.runs = 0

    def forward(self, *args):
        self.runs += 1
        raise self.error


@pytest.mark.parametrize(
    "error",
    [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
     RuntimeError("CUDA error: out of memory")],
    ids=["OutOfMemoryError", "RuntimeError"],
)  # fmt: skip
def test_running_out_of_memory_is_not_cached(error):
    impl = Failing(error)
    verdict = selfcheck.self_check(impl, CPU, torch.float32, 64)
    assert isinstance(verdict, BackendFailure) and verdict.transient
    assert "out of memory: not cached" in verdict
    selfcheck.self_check(impl, CPU, torch.float32, 64)
    assert impl.runs == 2


def test_other_errors_are_cached():
    impl = Failing(TypeError("_flash_attn_forward() got an unexpected keyword argument"))
    verdict = selfcheck.self_check(impl, CPU, torch.float32, 64)
    assert "TypeError: _flash_attn_forward() got an unexpected keyword" in verdict
    assert not verdict.transient
    selfcheck.self_check(impl, CPU, torch.float32, 64)
    assert impl.runs == 1


# ------------------------------------------------------------------ flash-attn FA3 -> FA2
def _fa_math(q, k, v, scale, causal, window_left, cu_q=None, cu_k=None):
    """Attention with the flash-attn conventions: +inf lse for rows that see nothing;
    lse [B, H, S] dense, [H, T] packed."""
    math_impl = registry.get("math")
    window = None if window_left < 0 else window_left

    def dense(q, k, v):
        spec = AttentionSpec(
            q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype,
            q.device, causal, window,
        )  # fmt: skip
        out, lse = math_impl.forward(q, k, v, spec, scale)
        return out, lse.float().masked_fill(torch.isneginf(lse), float("inf"))

    if cu_q is None:
        return dense(q, k, v)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        if q1 > q0 and k1 > k0:
            o, s = dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
            out[q0:q1], lse[:, q0:q1] = o[0], s[0]
    return out, lse


def _fa_math_backward(
    dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window_left, cu_q=None, cu_k=None
):
    """Gradients by autograd through math (the fake's backward), written in place."""
    with torch.enable_grad():  # the self-check runs under no_grad
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = _fa_math(q, k, v, scale, causal, window_left, cu_q, cu_k)
        grads = torch.autograd.grad(o, (q, k, v), dout)
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)


# FA2 >= 2.7: separate dense and varlen functions, window as two ints
def fa2_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):  # noqa: E501
    out, lse = _fa_math(q, k, v, softmax_scale, causal, window_size_left)
    return out, lse, None, None


def fa2_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):  # noqa: E501
    _fa_math_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size_left
    )


def fa2_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
):  # noqa: E501
    out, lse = _fa_math(
        q, k, v, softmax_scale, causal, window_size_left, cu_seqlens_q, cu_seqlens_k
    )
    return out, lse, None, None


def fa2_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):  # noqa: E501
    _fa_math_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        softmax_scale,
        causal,
        window_size_left,
        cu_seqlens_q,
        cu_seqlens_k,
    )


# an FA3 release whose forward declares paged-KV/rotary/FP8 arguments without defaults
def fa3_forward(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    seqlens_rotary,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):  # noqa: E501
    o, lse = _fa_math(q, k, v, softmax_scale, causal, window_size_left, cu_seqlens_q, cu_seqlens_k)
    return o, lse, None, None


def fa3_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    sequed_q,
    sequed_k,
    max_seqlen_q,
    max_seqlen_k,
    dq,
    dk,
    dv,
    softmax_scale,
    is_causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    deterministic=False,
    sm_margin=0,
):  # noqa: E501
    _fa_math_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        softmax_scale,
        is_causal,
        window_size_left,
        cu_seqlens_q,
        cu_seqlens_k,
    )


# an FA3 release that wants an argument usp cannot know
def fa3_forward_unknown(q, k, v, softmax_scale, causal, tile_scheduler_magic):
    raise AssertionError("never called: usp cannot fill tile_scheduler_magic")


FA2 = FlashAttnApi(
    "FA2", "fake.fa2", fa2_forward, fa2_backward, fa2_varlen_forward, fa2_varlen_backward
)
FA3 = FlashAttnApi("FA3", "fake.fa3", fa3_forward, fa3_backward, fa3_forward, fa3_backward)
FA3_UNKNOWN = FlashAttnApi(
    "FA3", "fake.fa3", fa3_forward_unknown, fa3_backward, fa3_forward_unknown, fa3_backward
)


def _spec(varlen=False):
    return AttentionSpec(1, 64, 64, 4, 2, 64, torch.float32, CPU, True, None, varlen=varlen)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_flash_attn_runs_fa3_when_it_passes(varlen, caplog):
    caplog.set_level(logging.INFO, logger="usp.kernels")
    chosen = choose_variant((FA3, FA2), _spec(varlen), {})
    assert not isinstance(chosen, str), chosen
    assert chosen.api.name == "FA3"
    assert "flash_attn runs FA3 (fake.fa3) on cpu" in caplog.text


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_flash_attn_falls_back_to_fa2_and_says_so(varlen, caplog):
    caplog.set_level(logging.INFO, logger="usp.kernels")
    memory = {}
    with pytest.warns(RuntimeWarning, match=r"flash_attn runs FA2 on cpu.*FA3 \(fake.fa3\) failed"):
        chosen = choose_variant((FA3_UNKNOWN, FA2), _spec(varlen), memory)
    assert not isinstance(chosen, str), chosen
    assert chosen.api.name == "FA2"
    assert "flash_attn runs FA2 (fake.fa2)" in caplog.text
    assert choose_variant((FA3_UNKNOWN, FA2), _spec(varlen), memory) is chosen  # remembered


def test_flash_attn_reports_every_generation_when_all_fail():
    broken_fa2 = FlashAttnApi(
        "FA2", "fake.fa2", fa3_forward_unknown, fa2_backward, fa3_forward_unknown, fa2_backward
    )
    verdict = choose_variant((FA3_UNKNOWN, broken_fa2), _spec(), {})
    assert isinstance(verdict, BackendFailure)
    assert "with FA3 (fake.fa3) failed its self-check" in verdict
    assert "with FA2 (fake.fa2) failed its self-check" in verdict
    assert "needs arguments usp does not know: ['tile_scheduler_magic']" in verdict


def test_flash_attn_backend_uses_the_generation_that_passed(monkeypatch):
    """The public backend delegates to the chosen generation and labels itself with it."""
    monkeypatch.setattr(flash_attn, "candidate_apis", lambda: (FA3_UNKNOWN, FA2))
    impl = flash_attn.FlashAttnBackend()
    spec = _spec()
    with pytest.warns(RuntimeWarning, match="flash_attn runs FA2"):
        assert impl.vet(spec, selfcheck.spec_verdict) is None
    assert impl.label(spec) == "flash_attn (FA2)"
    q, k = torch.randn(1, 64, 4, 64), torch.randn(1, 64, 2, 64)
    out, lse = impl.forward(q, k, k, spec, 0.125)
    expected, expected_lse = registry.get("math").forward(q, k, k, spec, 0.125)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)

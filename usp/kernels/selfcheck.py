"""A one-time correctness check of a backend on the device it is about to run on.

The CUDA backends and ``cpu`` call private aten ops and the flash-attn package, whose
signatures and conventions have moved between releases. Before a backend serves its
first call for a (device, dtype, head_dim) it runs small calls through the same
dispatcher real calls take (``usp.kernels.dispatch``), forward and backward,
against ``math`` in float64 on the same device, and is reported unsupported (a
:class:`BackendFailure`, which ``auto`` warns about) if it raises or disagrees.

What the calls cover, because each was a way for a broken kernel to pass a weaker check:
- a softmax scale that is not ``head_dim**-0.5`` (a dropped ``scale=`` would pass with
  the default), at the call's own head dim;
- batch 2, grouped-query heads (4 query heads on 2 KV heads);
- strided inputs: q/k/v are [B, S, H, D] views of [B, H, S, D] memory, as HuggingFace
  models hand them over;
- causal with Sq == Sk, Sq < Sk (bottom-right aligned) and Sq > Sk (rows that see no key
  must come back with out 0 and lse -inf), non-causal with Sq != Sk, and a left window
  where the backend has one;
- for backends with varlen kernels (checked separately, for packed calls): documents of
  unequal lengths, an empty one, one with more queries than keys.
Autocast is switched off inside, whatever the caller's context. Verdicts are cached per
(backend, device, dtype, head_dim, varlen); a failure from running out of memory is
returned but not cached, so the next call checks again.
"""

from __future__ import annotations

import dataclasses

import torch

from usp.compile_marks import constant_result
from usp.kernels.backends.base import Backend, BackendFailure
from usp.kernels.backends.math import MathBackend
from usp.kernels.dispatch import dense_backward, dense_forward, docs_backward, docs_forward
from usp.kernels.docs import PackedDocs
from usp.kernels.spec import AttentionSpec

# generous: catches wrong layouts, masks, scales and LSE conventions, not rounding
_TOLERANCE = {
    torch.float16: 5e-2,
    torch.bfloat16: 5e-2,
    torch.float32: 1e-3,
    torch.float64: 1e-9,
}
# the scale every check uses is this factor times head_dim**-0.5
SCALE_FACTOR = 0.6
_HEADS, _KV_HEADS, _BATCH = 4, 2, 2
# (Sq, Sk, causal, window)
_DENSE_CASES = (
    (64, 64, True, None),
    (48, 80, True, None),
    (80, 48, True, None),
    (40, 72, False, None),
)
_WINDOW_CASES = ((64, 64, True, 16), (40, 72, False, 8))
# document lengths of the packed check: an empty document, one with more queries than keys
_DOCS_Q = (1, 30, 0, 17, 12)
_DOCS_K = (1, 30, 0, 25, 5)

_verdicts: dict[tuple, str | None] = {}
_REFERENCE = MathBackend()


def clear_cache() -> None:
    """Forget every verdict (tests; or after changing the environment of a process)."""
    _verdicts.clear()


# Under torch.compile the check runs eagerly while the graph is traced and its verdict
# is a constant of the graph (it is a property of the device, dtype and head dim).
@constant_result
def self_check(
    impl: Backend, device: torch.device, dtype: torch.dtype, head_dim: int, *, varlen: bool = False
) -> str | None:
    """None if ``impl`` computes attention correctly here, else why not."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (impl.name, device, dtype, head_dim, varlen)
    if key in _verdicts:
        return _verdicts[key]
    verdict = _run(impl, device, dtype, head_dim, varlen)
    if not getattr(verdict, "transient", False):
        _verdicts[key] = verdict
    return verdict


def spec_verdict(impl: Backend, spec: AttentionSpec) -> str | None:
    """The (cached) verdict for a call's device, dtype and head dim and, for packed calls
    on a backend with varlen kernels, its varlen entry points too."""
    return self_check(impl, spec.device, spec.dtype, spec.head_dim, varlen=False) or (
        self_check(impl, spec.device, spec.dtype, spec.head_dim, varlen=True)
        if spec.varlen and impl.supports_varlen
        else None
    )


def _is_out_of_memory(err: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(err, oom) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


def _run(impl, device, dtype, head_dim, varlen) -> str | None:
    what = "packed (varlen) self-check" if varlen else "self-check"
    try:
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            check = _check_varlen if varlen else _check_dense
            problem = check(impl, device, dtype, head_dim)
    except Exception as err:  # any failure means: do not use this backend here
        transient = _is_out_of_memory(err)
        note = " (out of memory: not cached, checked again on the next call)" if transient else ""
        return BackendFailure.of(
            f"failed its {what} on {device}, {dtype}, head_dim={head_dim} "
            f"({type(err).__name__}: {str(err)[:300]}){note}",
            transient=transient,
        )
    if problem is None:
        return None
    return BackendFailure.of(
        f"failed its {what} on {device}, {dtype}, head_dim={head_dim} ({problem})"
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| over finite expected entries; inf if an
    infinite expected entry (a row that sees no key: lse -inf) is not matched exactly
    or a finite one is not finite."""
    actual, expected = actual.double(), expected.double()
    infinite = torch.isinf(expected)
    if not bool(torch.where(infinite, actual == expected, torch.isfinite(actual)).all()):
        return float("inf")
    diff = (actual - expected).masked_fill(infinite, 0.0).abs().max().item()
    return diff / max(expected.masked_fill(infinite, 0.0).abs().max().item(), 1e-6)


def _compare(names, actual, expected, dtype, where: str) -> str | None:
    for name, a, e in zip(names, actual, expected):
        err = relative_error(a, e)
        if err > _TOLERANCE[dtype]:
            return f"{name} off by {err:.2g} relative (bound {_TOLERANCE[dtype]:g}), {where}"
    return None


def _strided(gen, batch_dims, seqlen, heads, head_dim, device, dtype):
    """Random [..., S, H, D] in float64, and the same values as a strided view of
    [..., H, S, D] memory in ``dtype``."""
    memory = torch.randn(*batch_dims, heads, seqlen, head_dim, generator=gen, dtype=torch.float64)
    exact = memory.to(device).transpose(-3, -2)
    return exact.contiguous(), memory.to(device, dtype).transpose(-3, -2)


def _check_dense(impl, device, dtype, head_dim) -> str | None:
    reference = _REFERENCE
    scale = SCALE_FACTOR * head_dim**-0.5
    gen = torch.Generator().manual_seed(1234)
    cases = _DENSE_CASES + (_WINDOW_CASES if impl.supports_window else ())
    for seqlen_q, seqlen_k, causal, window in cases:
        spec = AttentionSpec(
            _BATCH, seqlen_q, seqlen_k, _HEADS, _KV_HEADS, head_dim, dtype, device, causal, window
        )
        q64, q = _strided(gen, (_BATCH,), seqlen_q, _HEADS, head_dim, device, dtype)
        k64, k = _strided(gen, (_BATCH,), seqlen_k, _KV_HEADS, head_dim, device, dtype)
        v64, v = _strided(gen, (_BATCH,), seqlen_k, _KV_HEADS, head_dim, device, dtype)
        dout64 = torch.randn(q64.shape, generator=gen, dtype=torch.float64).to(device)
        ref_spec = dataclasses.replace(spec, dtype=torch.float64)
        ref_out, ref_lse = dense_forward(reference, q64, k64, v64, ref_spec, scale)
        ref_grads = dense_backward(
            reference, dout64, q64, k64, v64, ref_out, ref_lse, ref_spec, scale
        )
        where = f"batch={_BATCH}, Sq={seqlen_q}, Sk={seqlen_k}, causal={causal}, window={window}, scale={scale:.4g}"
        problem = _compare(
            ("out", "lse"),
            dense_forward(impl, q, k, v, spec, scale),
            (ref_out, ref_lse),
            dtype,
            where,
        )
        if problem:
            return problem
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        grads = dense_backward(
            impl, dout64.to(dtype), q, k, v, ref_out.to(dtype), ref_lse.to(lse_dtype), spec, scale
        )
        problem = _compare(("dq", "dk", "dv"), grads, ref_grads, dtype, where)
        if problem:
            return problem
    return None


def _check_varlen(impl, device, dtype, head_dim) -> str | None:
    reference = _REFERENCE
    scale = SCALE_FACTOR * head_dim**-0.5
    gen = torch.Generator().manual_seed(4321)
    bounds_q = [0]
    bounds_k = [0]
    for len_q, len_k in zip(_DOCS_Q, _DOCS_K):
        bounds_q.append(bounds_q[-1] + len_q)
        bounds_k.append(bounds_k[-1] + len_k)
    docs = PackedDocs.build(bounds_q, bounds_k, device)
    windows = (None, 8) if impl.supports_window else (None,)
    for causal in (True, False):
        for window in windows:
            spec = AttentionSpec(
                1, bounds_q[-1], bounds_k[-1], _HEADS, _KV_HEADS, head_dim, dtype, device, causal,
                window, varlen=True,
            )  # fmt: skip
            q64, q = _strided(gen, (), bounds_q[-1], _HEADS, head_dim, device, dtype)
            k64, k = _strided(gen, (), bounds_k[-1], _KV_HEADS, head_dim, device, dtype)
            v64, v = _strided(gen, (), bounds_k[-1], _KV_HEADS, head_dim, device, dtype)
            dout64 = torch.randn(q64.shape, generator=gen, dtype=torch.float64).to(device)
            ref_spec = dataclasses.replace(spec, dtype=torch.float64)
            ref_out, ref_lse = docs_forward(reference, q64, k64, v64, docs, ref_spec, scale)
            ref_grads = docs_backward(
                reference, dout64, q64, k64, v64, ref_out, ref_lse, docs, ref_spec, scale
            )
            where = (
                f"documents q={_DOCS_Q} k={_DOCS_K}, causal={causal}, window={window}, "
                f"scale={scale:.4g}"
            )
            out = docs_forward(impl, q, k, v, docs, spec, scale)
            problem = _compare(("out", "lse"), out, (ref_out, ref_lse), dtype, where)
            if problem:
                return problem
            lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            grads = docs_backward(
                impl, dout64.to(dtype), q, k, v, ref_out.to(dtype), ref_lse.to(lse_dtype), docs,
                spec, scale,
            )  # fmt: skip
            problem = _compare(("dq", "dk", "dv"), grads, ref_grads, dtype, where)
            if problem:
                return problem
    return None

"""Public entry points of the local attention kernels, and backend selection."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

from usp.kernels.backends import registry
from usp.kernels.backends.base import Backend, BackendFailure, Grads
from usp.kernels.masks import accumulation_dtype, empty_row_count
from usp.kernels.merge import merge_pair
from usp.kernels.spec import (
    AttentionInputError,
    AttentionSpec,
    BackendUnavailableError,
    default_scale,
    validate_backward_inputs,
    validate_inputs,
)

logger = logging.getLogger("usp.kernels")

#: Off the CPU, ``auto`` falls back to ``math`` only for calls of at most this many
#: scores (B * H * Sq * Sk; for packed calls Tq * Tk bounds the per-document ones).
#: ``math`` materialises them in float32, several copies in the backward: 2**24 scores
#: are 64 MiB a copy. Beyond it ``auto`` raises (listing why every backend was refused)
#: instead of running out of memory, or crawling, at long lengths; ``backend="math"``
#: still forces it.
MATH_AUTO_MAX_SCORES = 2**24

# (backend, reason) pairs already reported by ``auto``: each is logged (and, for a
# failure, warned about) once per process, not once per layer and ring step.
_reported_skips: set[tuple[str, str]] = set()


def select_backend(spec: AttentionSpec, backend: str = "auto") -> Backend:
    """The backend that will run a call: the named one, or the fastest that supports it.

    Runs no kernel except a backend's one-time self-check, so callers can use it to
    validate a call before any communication. Raises AttentionInputError for an unknown
    name and BackendUnavailableError (with every backend's reason) when nothing fits.
    """
    if backend == "auto":
        return _select_auto(spec)
    if backend not in registry.BACKEND_NAMES:
        raise AttentionInputError(
            f"unknown attention backend {backend!r}; valid names: "
            f"{', '.join(('auto',) + registry.BACKEND_NAMES)}"
        )
    impl = registry.get(backend)
    reason = impl.unsupported_reason(spec)
    if reason is not None:
        able = [
            n for n in registry.BACKEND_NAMES if registry.get(n).unsupported_reason(spec) is None
        ]
        raise BackendUnavailableError(
            f"attention backend {backend!r} cannot run {_describe(spec)}: it {reason}. "
            f"Backends that can: {', '.join(able) or 'none'}"
        )
    return impl


def _auto_reason(name: str, spec: AttentionSpec) -> str | None:
    reason = registry.get(name).unsupported_reason(spec)
    if reason is None and name == "math" and spec.device.type != "cpu":
        scores = spec.batch * spec.num_heads * spec.seqlen_q * spec.seqlen_k
        if scores > MATH_AUTO_MAX_SCORES:
            reason = (
                f"would materialise {scores} float32 scores (B*H*Sq*Sk) on "
                f"{spec.device.type}; auto falls back to it there only up to "
                f"{MATH_AUTO_MAX_SCORES} (backend='math' forces it)"
            )
    return reason


def _select_auto(spec: AttentionSpec) -> Backend:
    order = registry.auto_order(spec.device)
    if spec.varlen:  # native varlen kernels first; others loop over documents
        order = sorted(order, key=lambda name: not registry.get(name).supports_varlen)
    skipped = []
    for name in order:
        reason = _auto_reason(name, spec)
        if reason is None:
            for skipped_name, skipped_reason in skipped:
                _report_skip(skipped_name, skipped_reason, name, spec)
            return registry.get(name)
        skipped.append((name, reason))
    raise BackendUnavailableError(
        f"no attention backend can run {_describe(spec)}. "
        + "; ".join(f"{name}: it {reason}" for name, reason in skipped)
    )


def _report_skip(name: str, reason: str, chosen: str, spec: AttentionSpec) -> None:
    key = (name, str(reason))
    if key in _reported_skips:
        return
    _reported_skips.add(key)
    message = f"attention backend {name!r} skipped by auto: it {reason}; using {chosen!r}"
    if isinstance(reason, BackendFailure):
        logger.warning("%s (%s)", message, _describe(spec))
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    else:
        logger.info("%s (%s)", message, _describe(spec))


def _describe(spec: AttentionSpec) -> str:
    window = f", window={spec.window}" if spec.window is not None else ""
    varlen = ", packed" if spec.varlen else ""
    return (
        f"this call ({spec.device.type}, {spec.dtype}, batch={spec.batch}, "
        f"Sq={spec.seqlen_q}, Sk={spec.seqlen_k}, head_dim={spec.head_dim}, "
        f"heads={spec.num_heads}/{spec.num_kv_heads}, causal={spec.causal}{window}{varlen})"
    )


def prepare_call(q, k, v, causal, window, softmax_scale, backend, varlen=False):
    """Validate a call and resolve its (backend, spec, softmax scale)."""
    spec = validate_inputs(q, k, v, causal=causal, window=window, varlen=varlen)
    return select_backend(spec, backend), spec, default_scale(spec.head_dim, softmax_scale)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention that also returns the log-sum-exp.

    q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (H % Hkv == 0) -> out [B, Sq, H, D] in q's
    dtype, lse [B, H, Sq] in float32 (float64 for float64 inputs). Causal masks are
    bottom-right aligned when Sq != Sk; ``window`` is a left window (see ``spec.py``).
    """
    impl, spec, scale = prepare_call(q, k, v, causal, window, softmax_scale, backend)
    return dense_forward(impl, q, k, v, spec, scale)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
) -> Grads:
    """Gradients of :func:`attention_forward` given the (possibly externally merged)
    ``out`` and ``lse``; returns (dq, dk, dv) in the inputs' dtypes and shapes."""
    impl, spec, scale = prepare_call(q, k, v, causal, window, softmax_scale, backend)
    validate_backward_inputs(dout, out, lse, q)
    return dense_backward(impl, dout, q, k, v, out, lse, spec, scale)


# ------------------------------------------------------------------ dense dispatch
def _needs_split(impl: Backend, spec: AttentionSpec) -> bool:
    """Causal with Sq < Sk on a backend that only knows square causal blocks."""
    return spec.causal and not spec.square and spec.window is None and not impl.bottom_right_causal


def _kernel(impl: Backend, spec: AttentionSpec) -> Backend:
    """The backend a kernel call goes to: ``math`` for calls below its key minimum."""
    return registry.get("math") if spec.seqlen_k < impl.min_seqlen_k else impl


def dense_forward(impl: Backend, q, k, v, spec: AttentionSpec, scale: float):
    """Run a validated call. Rows that see no key (all of them without keys; the first
    Sq - Sk when causal with Sq > Sk) are never given to a kernel: they get out = 0 and
    lse = -inf here, from the mask geometry, whatever a kernel would write for them."""
    batch, seqlen_q, heads = spec.batch, spec.seqlen_q, spec.num_heads
    empty = empty_row_count(seqlen_q, spec.seqlen_k, spec.causal)
    if empty == 0 and seqlen_q > 0:
        return _forward_rows_that_see_keys(impl, q, k, v, spec, scale)
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=acc, device=q.device)
    if empty < seqlen_q:
        seeing = dataclasses.replace(spec, seqlen_q=seqlen_q - empty)
        out[:, empty:], lse[:, :, empty:] = _forward_rows_that_see_keys(
            impl, q[:, empty:], k, v, seeing, scale
        )
    return out, lse


def _forward_rows_that_see_keys(impl: Backend, q, k, v, spec: AttentionSpec, scale: float):
    """Every row sees a key (so Sq <= Sk if causal). Bottom-right causal with Sq < Sk on
    a square-only backend is split into the keys every row sees (full) and a square
    causal block, merged by LSE."""
    acc = accumulation_dtype(q.dtype)
    if not _needs_split(impl, spec):
        out, lse = _kernel(impl, spec).forward(q, k, v, spec, scale)
        return out, lse.to(acc)
    prefix = spec.seqlen_k - spec.seqlen_q
    full = dataclasses.replace(spec, seqlen_k=prefix, causal=False)
    square = dataclasses.replace(spec, seqlen_k=spec.seqlen_q)
    out_full, lse_full = _kernel(impl, full).forward(q, k[:, :prefix], v[:, :prefix], full, scale)
    out_diag, lse_diag = _kernel(impl, square).forward(
        q, k[:, prefix:], v[:, prefix:], square, scale
    )
    out, lse = merge_pair(out_full, lse_full.to(acc), out_diag, lse_diag.to(acc))
    return out.to(q.dtype), lse


def dense_backward(
    impl: Backend, dout, q, k, v, out, lse, spec: AttentionSpec, scale: float
) -> Grads:
    """Gradients of :func:`dense_forward`; rows that see no key get dq = 0 and add nothing
    to dk/dv, without a kernel call."""
    seqlen_q = spec.seqlen_q
    empty = empty_row_count(seqlen_q, spec.seqlen_k, spec.causal)
    if empty == 0 and seqlen_q > 0:
        return _backward_rows_that_see_keys(impl, dout, q, k, v, out, lse, spec, scale)
    if empty == seqlen_q:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    seeing = dataclasses.replace(spec, seqlen_q=seqlen_q - empty)
    dq_seeing, dk, dv = _backward_rows_that_see_keys(
        impl,
        dout[:, empty:],
        q[:, empty:],
        k,
        v,
        out[:, empty:],
        lse[:, :, empty:],
        seeing,
        scale,
    )
    return torch.cat([torch.zeros_like(q[:, :empty]), dq_seeing], dim=1), dk, dv


def _backward_rows_that_see_keys(
    impl: Backend, dout, q, k, v, out, lse, spec: AttentionSpec, scale: float
) -> Grads:
    if not _needs_split(impl, spec):
        return _kernel(impl, spec).backward(dout, q, k, v, out, lse, spec, scale)
    prefix = spec.seqlen_k - spec.seqlen_q
    full = dataclasses.replace(spec, seqlen_k=prefix, causal=False)
    square = dataclasses.replace(spec, seqlen_k=spec.seqlen_q)
    dq_full, dk_full, dv_full = _kernel(impl, full).backward(
        dout, q, k[:, :prefix], v[:, :prefix], out, lse, full, scale
    )
    dq_diag, dk_diag, dv_diag = _kernel(impl, square).backward(
        dout, q, k[:, prefix:], v[:, prefix:], out, lse, square, scale
    )
    dq = (dq_full.to(accumulation_dtype(q.dtype)) + dq_diag).to(q.dtype)
    return dq, torch.cat([dk_full, dk_diag], dim=1), torch.cat([dv_full, dv_diag], dim=1)

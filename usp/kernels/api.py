"""Public entry points of the local attention kernels, and backend selection."""

from __future__ import annotations

import dataclasses

import torch

from usp.kernels.backends import registry
from usp.kernels.backends.base import Backend, Grads
from usp.kernels.masks import accumulation_dtype
from usp.kernels.merge import merge_pair
from usp.kernels.spec import (
    AttentionInputError,
    AttentionSpec,
    BackendUnavailableError,
    default_scale,
    validate_backward_inputs,
    validate_inputs,
)


def select_backend(spec: AttentionSpec, backend: str = "auto") -> Backend:
    """The backend that will run a call: the named one, or the fastest that supports it."""
    if backend == "auto":
        order = registry.auto_order(spec.device)
        if spec.varlen:  # native varlen kernels first; others loop over documents
            order = sorted(order, key=lambda name: not registry.get(name).supports_varlen)
        for name in order:
            impl = registry.get(name)
            if impl.unsupported_reason(spec) is None:
                return impl
        raise BackendUnavailableError(f"no attention backend supports {_describe(spec)}")
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


def _describe(spec: AttentionSpec) -> str:
    window = f", window={spec.window}" if spec.window is not None else ""
    return (
        f"this call ({spec.device.type}, {spec.dtype}, head_dim={spec.head_dim}, "
        f"heads={spec.num_heads}/{spec.num_kv_heads}, causal={spec.causal}{window})"
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
    """Causal with Sq != Sk on a backend that only knows square causal blocks."""
    return spec.causal and not spec.square and spec.window is None and not impl.bottom_right_causal


def dense_forward(impl: Backend, q, k, v, spec: AttentionSpec, scale: float):
    """Run a validated call. Bottom-right causal with Sq < Sk is split into the keys
    every row sees (full) and a square causal block; with Sq > Sk the first Sq - Sk rows
    see nothing."""
    batch, seqlen_q, heads = spec.batch, spec.seqlen_q, spec.num_heads
    acc = accumulation_dtype(q.dtype)
    if spec.seqlen_k == 0 or seqlen_q == 0:
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        return out, torch.full((batch, heads, seqlen_q), float("-inf"), dtype=acc, device=q.device)
    if not _needs_split(impl, spec):
        return impl.forward(q, k, v, spec, scale)
    square = dataclasses.replace(
        spec, seqlen_q=min(seqlen_q, spec.seqlen_k), seqlen_k=min(seqlen_q, spec.seqlen_k)
    )
    if seqlen_q > spec.seqlen_k:
        skip = seqlen_q - spec.seqlen_k
        part_out, part_lse = impl.forward(q[:, skip:], k, v, square, scale)
        out = torch.cat([q.new_zeros(q[:, :skip].shape[:-1] + (v.shape[-1],)), part_out], dim=1)
        lse = torch.cat(
            [
                torch.full((batch, heads, skip), float("-inf"), dtype=acc, device=q.device),
                part_lse.to(acc),
            ],
            dim=2,
        )
        return out, lse
    prefix = spec.seqlen_k - seqlen_q
    full = dataclasses.replace(spec, seqlen_k=prefix, causal=False)
    out_full, lse_full = impl.forward(q, k[:, :prefix], v[:, :prefix], full, scale)
    out_diag, lse_diag = impl.forward(q, k[:, prefix:], v[:, prefix:], square, scale)
    out, lse = merge_pair(out_full, lse_full.to(acc), out_diag, lse_diag)
    return out.to(q.dtype), lse


def dense_backward(
    impl: Backend, dout, q, k, v, out, lse, spec: AttentionSpec, scale: float
) -> Grads:
    seqlen_q, seqlen_k = spec.seqlen_q, spec.seqlen_k
    if seqlen_k == 0 or seqlen_q == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if not _needs_split(impl, spec):
        return impl.backward(dout, q, k, v, out, lse, spec, scale)
    square = dataclasses.replace(
        spec, seqlen_q=min(seqlen_q, seqlen_k), seqlen_k=min(seqlen_q, seqlen_k)
    )
    if seqlen_q > seqlen_k:
        skip = seqlen_q - seqlen_k
        dq_part, dk, dv = impl.backward(
            dout[:, skip:], q[:, skip:], k, v, out[:, skip:], lse[:, :, skip:], square, scale
        )
        return torch.cat([torch.zeros_like(q[:, :skip]), dq_part], dim=1), dk, dv
    prefix = seqlen_k - seqlen_q
    full = dataclasses.replace(spec, seqlen_k=prefix, causal=False)
    dq_full, dk_full, dv_full = impl.backward(
        dout, q, k[:, :prefix], v[:, :prefix], out, lse, full, scale
    )
    dq_diag, dk_diag, dv_diag = impl.backward(
        dout, q, k[:, prefix:], v[:, prefix:], out, lse, square, scale
    )
    dq = (dq_full.to(accumulation_dtype(q.dtype)) + dq_diag).to(q.dtype)
    return dq, torch.cat([dk_full, dk_diag], dim=1), torch.cat([dv_full, dv_diag], dim=1)

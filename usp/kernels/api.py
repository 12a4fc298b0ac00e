"""Public entry points of the local attention kernels: validation, backend selection and
the scale default per call, then the dispatcher (``usp.kernels.dispatch``)."""

from __future__ import annotations

import torch

from usp.kernels.backends.base import Grads
from usp.kernels.dispatch import dense_backward, dense_forward
from usp.kernels.selection import MATH_AUTO_MAX_SCORES, select_backend
from usp.kernels.spec import default_scale, validate_backward_inputs, validate_inputs

__all__ = [
    "MATH_AUTO_MAX_SCORES",
    "attention_backward",
    "attention_forward",
    "dense_backward",
    "dense_forward",
    "prepare_call",
    "select_backend",
]


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

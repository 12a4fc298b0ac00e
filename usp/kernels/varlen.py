"""Variable-length (packed) attention: documents attend only within themselves.

Layout: q [Tq, H, D], k/v [Tk, Hkv, D]; ``cu_seqlens_q``/``cu_seqlens_k`` are int32
[N+1] cumulative boundaries; document i is ``q[cu_q[i]:cu_q[i+1]]`` against
``k[cu_k[i]:cu_k[i+1]]`` with the dense masking semantics (bottom-right causal per
document). lse is [H, Tq]. Backends without native varlen kernels run one dense call
per document: correct, and fast enough on CPU.
"""

from __future__ import annotations

import torch

from usp.kernels.api import prepare_call
from usp.kernels.backends.base import Grads
from usp.kernels.dispatch import docs_backward, docs_forward
from usp.kernels.docs import PackedDocs
from usp.kernels.spec import (
    AttentionInputError,
    validate_backward_inputs,
    validate_cu_seqlens,
    validate_inputs,
)

__all__ = [
    "PackedDocs",
    "attention_varlen_backward",
    "attention_varlen_forward",
    "docs_backward",
    "docs_forward",
    "packed_backward",
    "packed_forward",
]


def _packed_docs(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k) -> PackedDocs:
    bounds_q = validate_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    bounds_k = validate_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    docs = PackedDocs.build(bounds_q, bounds_k, q.device, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k)
    for name, given, actual in (
        ("max_seqlen_q", max_seqlen_q, docs.max_q),
        ("max_seqlen_k", max_seqlen_k, docs.max_k),
    ):
        if given is not None and given < actual:
            raise AttentionInputError(
                f"{name}={given} is smaller than the longest document ({actual})"
            )
    return docs


def attention_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention with LSE: out [Tq, H, D] (q's dtype), lse [H, Tq] (float32/64)."""
    validate_inputs(q, k, v, causal=causal, window=window, varlen=True)
    docs = _packed_docs(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    return packed_forward(
        q, k, v, docs, causal=causal, softmax_scale=softmax_scale, window=window, backend=backend
    )


def attention_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
) -> Grads:
    """Gradients of :func:`attention_varlen_forward` given (possibly merged) out and lse."""
    validate_inputs(q, k, v, causal=causal, window=window, varlen=True)
    validate_backward_inputs(dout, out, lse, q, varlen=True)
    docs = _packed_docs(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    return packed_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        docs,
        causal=causal,
        softmax_scale=softmax_scale,
        window=window,
        backend=backend,
    )


def packed_forward(
    q, k, v, docs: PackedDocs, *, causal, softmax_scale=None, window=None, backend="auto"
):
    """:func:`attention_varlen_forward` for pre-validated boundaries: no host syncs and
    no host-to-device copies (``docs`` carries its device tensors)."""
    impl, spec, scale = prepare_call(q, k, v, causal, window, softmax_scale, backend, varlen=True)
    return docs_forward(impl, q, k, v, docs, spec, scale)


def packed_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    docs: PackedDocs,
    *,
    causal,
    softmax_scale=None,
    window=None,
    backend="auto",
) -> Grads:
    impl, spec, scale = prepare_call(q, k, v, causal, window, softmax_scale, backend, varlen=True)
    return docs_backward(impl, dout, q, k, v, out, lse, docs, spec, scale)

"""Variable-length (packed) attention: documents attend only within themselves.

Layout: q [Tq, H, D], k/v [Tk, Hkv, D]; ``cu_seqlens_q``/``cu_seqlens_k`` are int32
[N+1] cumulative boundaries; document i is ``q[cu_q[i]:cu_q[i+1]]`` against
``k[cu_k[i]:cu_k[i+1]]`` with the dense masking semantics (bottom-right causal per
document). lse is [H, Tq]. Backends without native varlen kernels run one dense call
per document: correct, and fast enough on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from usp.kernels.api import dense_backward, dense_forward, prepare_call
from usp.kernels.backends.base import Backend, Grads
from usp.kernels.masks import accumulation_dtype
from usp.kernels.spec import (
    AttentionInputError,
    AttentionSpec,
    validate_backward_inputs,
    validate_cu_seqlens,
    validate_inputs,
)


@dataclass(frozen=True)
class PackedDocs:
    """Validated document boundaries, ready for repeated varlen calls.

    ``bounds_*`` are the Python boundaries (for per-document loops), ``cu_*`` the int32
    tensors on the compute device (for native varlen kernels).
    """

    bounds_q: tuple[int, ...]
    bounds_k: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @classmethod
    def build(cls, bounds_q, bounds_k, device) -> PackedDocs:
        if len(bounds_q) != len(bounds_k):
            raise AttentionInputError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
                f"got {len(bounds_q) - 1} and {len(bounds_k) - 1}"
            )
        as_tensor = lambda b: torch.tensor(b, dtype=torch.int32, device=device)  # noqa: E731
        longest = lambda b: max(y - x for x, y in zip(b, b[1:]))  # noqa: E731
        return cls(
            tuple(bounds_q),
            tuple(bounds_k),
            as_tensor(bounds_q),
            as_tensor(bounds_k),
            longest(bounds_q),
            longest(bounds_k),
        )

    def pairs(self):
        """((q0, q1), (k0, k1)) per document."""
        bq, bk = self.bounds_q, self.bounds_k
        return zip(zip(bq, bq[1:]), zip(bk, bk[1:]))


def _packed_docs(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k) -> PackedDocs:
    bounds_q = validate_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    bounds_k = validate_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    docs = PackedDocs.build(bounds_q, bounds_k, q.device)
    for name, given, actual in (
        ("max_seqlen_q", max_seqlen_q, docs.max_q),
        ("max_seqlen_k", max_seqlen_k, docs.max_k),
    ):
        if given is not None and given < actual:
            raise AttentionInputError(
                f"{name}={given} is smaller than the longest document ({actual})"
            )
    return docs


def _doc_spec(spec: AttentionSpec, len_q: int, len_k: int) -> AttentionSpec:
    return dataclasses.replace(spec, batch=1, seqlen_q=len_q, seqlen_k=len_k, varlen=False)


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
    """:func:`attention_varlen_forward` for pre-validated boundaries (no host syncs)."""
    impl, spec, scale = prepare_call(q, k, v, causal, window, softmax_scale, backend, varlen=True)
    if impl.supports_varlen:
        return impl.varlen_forward(
            q, k, v, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, spec, scale
        )
    return _per_document_forward(impl, q, k, v, docs, spec, scale)


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
    if impl.supports_varlen:
        return impl.varlen_backward(
            dout, q, k, v, out, lse, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, spec, scale
        )
    return _per_document_backward(impl, dout, q, k, v, out, lse, docs, spec, scale)


def _per_document_forward(impl: Backend, q, k, v, docs: PackedDocs, spec, scale):
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty(
        (spec.num_heads, q.shape[0]), dtype=accumulation_dtype(q.dtype), device=q.device
    )
    for (q0, q1), (k0, k1) in docs.pairs():
        if q1 == q0:
            continue
        doc_out, doc_lse = dense_forward(
            impl,
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            _doc_spec(spec, q1 - q0, k1 - k0),
            scale,
        )
        out[q0:q1] = doc_out[0]
        lse[:, q0:q1] = doc_lse[0]
    return out, lse


def _per_document_backward(
    impl: Backend, dout, q, k, v, out, lse, docs: PackedDocs, spec, scale
) -> Grads:
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    for (q0, q1), (k0, k1) in docs.pairs():
        if q1 == q0:
            dk[k0:k1] = 0
            dv[k0:k1] = 0
            continue
        grads = dense_backward(
            impl,
            dout[None, q0:q1],
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            out[None, q0:q1],
            lse[None, :, q0:q1],
            _doc_spec(spec, q1 - q0, k1 - k0),
            scale,
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
    return dq, dk, dv

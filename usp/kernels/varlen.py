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


def _device_bounds(bounds, device: torch.device) -> torch.Tensor:
    """int32 boundaries on ``device``. On CUDA the copy goes through pinned memory with
    ``non_blocking``: it is queued on the stream instead of making the host wait for
    the work already queued there (a plain host-to-device copy would)."""
    host = torch.tensor(bounds, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class PackedDocs:
    """Validated document boundaries, ready for repeated varlen calls: build it once per
    batch and pass it to every layer's :func:`packed_forward`/:func:`packed_backward`.

    ``bounds_*`` are the Python boundaries (for per-document loops), ``cu_*`` the int32
    tensors on the compute device (for native varlen kernels), ``max_*`` the longest
    document: a call reads nothing back from the device and copies nothing to it.
    """

    bounds_q: tuple[int, ...]
    bounds_k: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @classmethod
    def build(cls, bounds_q, bounds_k, device, *, cu_q=None, cu_k=None) -> PackedDocs:
        """From Python boundaries [0, ..., total]; ``cu_q``/``cu_k``, when given, are the
        same boundaries already on ``device`` (int32), reused instead of copied."""
        if len(bounds_q) != len(bounds_k):
            raise AttentionInputError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
                f"got {len(bounds_q) - 1} and {len(bounds_k) - 1}"
            )

        def on_device(given, bounds):
            usable = (
                given is not None
                and given.device == torch.device(device)
                and given.dtype == torch.int32
                and given.is_contiguous()
            )
            return given if usable else _device_bounds(bounds, device)

        longest = lambda b: max(y - x for x, y in zip(b, b[1:]))  # noqa: E731
        return cls(
            tuple(bounds_q),
            tuple(bounds_k),
            on_device(cu_q, bounds_q),
            on_device(cu_k, bounds_k),
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


def docs_forward(impl: Backend, q, k, v, docs: PackedDocs, spec: AttentionSpec, scale: float):
    """Run a validated packed call on a chosen backend: its varlen kernel, or one dense
    call per document."""
    if impl.supports_varlen:
        return impl.varlen_forward(
            q, k, v, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, spec, scale
        )
    return _per_document_forward(impl, q, k, v, docs, spec, scale)


def docs_backward(
    impl: Backend, dout, q, k, v, out, lse, docs: PackedDocs, spec: AttentionSpec, scale: float
) -> Grads:
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

"""The dispatcher: runs a validated call on a chosen backend, with no validation and no
backend selection (callers did both once, e.g. ``prepare_call`` or a ring call's
``BlockKernels``).

Dense: rows that see no key never reach a kernel; causal Sq < Sk goes to a square-only
backend as a full block plus a square causal block merged by LSE; calls with fewer keys
than a backend's ``min_seqlen_k`` run on ``math``. Packed: the backend's varlen kernel,
or one dense call per document.
"""

from __future__ import annotations

import dataclasses

import torch

from usp.kernels.backends.base import Backend, Grads
from usp.kernels.backends.math import MathBackend
from usp.kernels.docs import PackedDocs
from usp.kernels.masks import accumulation_dtype, empty_row_count
from usp.kernels.merge import merge_pair
from usp.kernels.spec import AttentionSpec

_MATH = MathBackend()


def _needs_split(impl: Backend, spec: AttentionSpec) -> bool:
    """Causal with Sq < Sk on a backend that only knows square causal blocks."""
    return spec.causal and not spec.square and spec.window is None and not impl.bottom_right_causal


def _kernel(impl: Backend, spec: AttentionSpec) -> Backend:
    """The backend a kernel call goes to: ``math`` for calls below its key minimum."""
    return _MATH if spec.seqlen_k < impl.min_seqlen_k else impl


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


# ------------------------------------------------------------------ packed documents
def _lens(q, k) -> tuple[int, int]:
    return q.shape[0], k.shape[0]


def _doc_spec(spec: AttentionSpec, len_q: int, len_k: int) -> AttentionSpec:
    # built directly: dataclasses.replace costs several times more, once per document
    return AttentionSpec(
        1, len_q, len_k, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype,
        spec.device, spec.causal, spec.window,
    )  # fmt: skip


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


def _whole(docs: PackedDocs, len_q: int, len_k: int) -> bool:
    """One document holding every q row and every k row: one dense call, nothing to copy."""
    return (
        len(docs.bounds_q) == 2
        and len_q > 0
        and docs.bounds_q[1] - docs.bounds_q[0] == len_q
        and (docs.bounds_k[1] - docs.bounds_k[0] == len_k)
    )


def _per_document_forward(impl: Backend, q, k, v, docs: PackedDocs, spec, scale):
    if _whole(docs, q.shape[0], k.shape[0]):  # [n, h, D] -> [1, n, h, D] and back
        out, lse = dense_forward(
            impl, q[None], k[None], v[None], _doc_spec(spec, *_lens(q, k)), scale
        )
        return out[0], lse[0]
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
    if _whole(docs, q.shape[0], k.shape[0]):  # the kernel's gradients as they are
        grads = dense_backward(
            impl, dout[None], q[None], k[None], v[None], out[None], lse[None],
            _doc_spec(spec, *_lens(q, k)), scale,
        )  # fmt: skip
        return tuple(g[0] for g in grads)
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

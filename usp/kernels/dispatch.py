"""The dispatcher: runs a validated call on a chosen backend, with no validation and no
backend selection (callers did both once, e.g. ``prepare_call`` or a ring call's
``BlockKernels``).

Dense: rows that see no key never reach a kernel; causal Sq < Sk goes to a square-only
backend as a full block plus a square causal block merged by LSE; calls with fewer keys
than a backend's ``min_seqlen_k`` run on ``math``. Packed: the backend's varlen kernel,
or one dense call per document. :class:`PreparedDense` and :class:`DocumentCalls` make
those decisions once for a call shape that runs many times (a ring's blocks).
"""

from __future__ import annotations

import dataclasses

import torch
from torch._guards import active_fake_mode

from usp.kernels.backends.base import Backend, Grads
from usp.kernels.backends.math import MathBackend
from usp.kernels.docs import DeviceBounds, PackedDocs
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


class PreparedDense:
    """A dense call of one shape with its decisions made once (empty rows, the causal
    split, ``math`` below a key minimum): a ring runs each block shape at every step,
    and a packed call each document shape at every block. ``forward``/``backward`` are
    :func:`dense_forward`/:func:`dense_backward` on tensors of that shape."""

    __slots__ = ("impl", "spec", "scale", "_direct", "_acc")

    def __init__(self, impl: Backend, spec: AttentionSpec, scale: float):
        self.impl, self.spec, self.scale = impl, spec, scale
        plain = (
            spec.seqlen_q > 0 and empty_row_count(spec.seqlen_q, spec.seqlen_k, spec.causal) == 0
        )
        # every row sees a key and no split: the kernel's own call, nothing around it
        self._direct = _kernel(impl, spec) if plain and not _needs_split(impl, spec) else None
        self._acc = accumulation_dtype(spec.dtype)

    def forward(self, q, k, v):
        if self._direct is None:
            return dense_forward(self.impl, q, k, v, self.spec, self.scale)
        out, lse = self._direct.forward(q, k, v, self.spec, self.scale)
        return out, lse.to(self._acc)

    def backward(self, dout, q, k, v, out, lse) -> Grads:
        if self._direct is None:
            return dense_backward(self.impl, dout, q, k, v, out, lse, self.spec, self.scale)
        return self._direct.backward(dout, q, k, v, out, lse, self.spec, self.scale)


# ------------------------------------------------------------------ packed documents
def _doc_spec(spec: AttentionSpec, len_q: int, len_k: int, batch: int = 1) -> AttentionSpec:
    # built directly: dataclasses.replace costs several times more, once per document
    return AttentionSpec(
        batch, len_q, len_k, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype,
        spec.device, spec.causal, spec.window,
    )  # fmt: skip


def docs_forward(
    impl: Backend, q, k, v, docs: PackedDocs | DeviceBounds, spec: AttentionSpec, scale: float
):
    """Run a validated packed call (q [Tq, H, D], k/v [Tk, Hkv, D]) on a chosen backend:
    its varlen kernel, or one dense call per document. A varlen kernel reads only the
    device boundaries and bounds (``DeviceBounds`` is enough); per-document calls need
    a :class:`PackedDocs`."""
    if impl.supports_varlen:
        return impl.varlen_forward(
            q, k, v, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, spec, scale
        )
    out, lse = document_calls(impl, docs, spec, scale).forward(q[None], k[None], v[None])
    return out[0], lse[0]


def docs_backward(
    impl: Backend, dout, q, k, v, out, lse, docs: PackedDocs | DeviceBounds,
    spec: AttentionSpec, scale: float,
) -> Grads:  # fmt: skip
    if impl.supports_varlen:
        return impl.varlen_backward(
            dout, q, k, v, out, lse, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, spec, scale
        )
    batched = (x[None] for x in (dout, q, k, v, out, lse))
    return tuple(g[0] for g in document_calls(impl, docs, spec, scale).backward(*batched))


def document_calls(
    impl: Backend, docs: PackedDocs, spec: AttentionSpec, scale: float
) -> DocumentCalls:
    """The :class:`DocumentCalls` of ``docs`` for a call shape, built once per batch: kept
    in ``docs.per_document``, since one batch's boundaries serve every layer, forward and
    backward. Under fake tensors (the planner) it is built per call, so that no fake
    index tensor outlives its mode in a cache."""
    if active_fake_mode() is not None:
        return DocumentCalls(impl, docs, spec, scale)
    key = (impl.name, spec, scale)
    calls = docs.per_document.get(key)
    if calls is None:
        calls = docs.per_document[key] = DocumentCalls(impl, docs, spec, scale)
    return calls


class _DocumentRows:
    """The rows of ``count`` documents of one length in a packed tensor's token dim: a
    contiguous run from ``start``, or (documents apart) an index of their rows."""

    __slots__ = ("count", "length", "start", "index")

    def __init__(self, starts: list[int], length: int, device: torch.device):
        self.count, self.length = len(starts), length
        run = all(b - a == length for a, b in zip(starts, starts[1:]))
        self.start = starts[0] if run else None
        self.index = None
        if not run:
            offsets = torch.arange(length, device=device)
            self.index = (torch.tensor(starts, device=device)[:, None] + offsets).reshape(-1)

    def _rows(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.index is None:
            return x.narrow(dim, self.start, self.count * self.length)
        return x.index_select(dim, self.index)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, h, D] -> the documents as a batch [count, length, h, D]."""
        return self._rows(x, 1).reshape((self.count, self.length) + x.shape[2:])

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """lse [1, H, T] -> [count, H, length]."""
        return self._rows(lse, 2).reshape(lse.shape[1], self.count, self.length).transpose(0, 1)

    def put(self, x: torch.Tensor, value: torch.Tensor) -> None:
        """x [1, T, h, D] (contiguous): the documents' rows = value [count, length, h, D]."""
        if self.index is None:
            x.narrow(1, self.start, self.count * self.length).view(value.shape).copy_(value)
        else:
            x.index_copy_(1, self.index, value.reshape((1, -1) + value.shape[2:]))

    def put_lse(self, lse: torch.Tensor, value: torch.Tensor) -> None:
        """lse [1, H, T] (contiguous): the documents' rows = value [count, H, length]."""
        by_head = value.transpose(0, 1)  # [H, count, length]
        if self.index is None:
            rows = lse.narrow(2, self.start, self.count * self.length)
            rows.view(by_head.shape).copy_(by_head)
        else:
            lse.index_copy_(2, self.index, by_head.reshape(1, lse.shape[1], -1))


class DocumentCalls:
    """Dense calls per document of a packed call, on [1, T, h, D] tensors (for backends
    without a varlen kernel). Built once per call shape: each document's
    :class:`PreparedDense` and its rows are worked out here, not per document and call.

    On the CPU, documents of the same (q, k) lengths run as one batched call (their rows
    gathered into a batch, the results put back): a packed batch of many short documents
    padded to a multiple has few distinct lengths, and a kernel call costs far more host
    time than the gather. Attention is per document either way, so the result is the
    same. Elsewhere (CUDA: the gather's index would be a host-to-device copy per call)
    each document is its own call."""

    __slots__ = ("_whole", "_documents", "_groups", "_empty_q", "_heads", "_acc")

    def __init__(self, impl: Backend, docs: PackedDocs, spec: AttentionSpec, scale: float):
        len_q, len_k = spec.seqlen_q, spec.seqlen_k
        self._acc = accumulation_dtype(spec.dtype)
        self._heads = spec.num_heads
        # one document holding every q row and every k row: one dense call, nothing to copy
        whole = len(docs.bounds_q) == 2 and len_q > 0
        whole = whole and docs.bounds_q[1] - docs.bounds_q[0] == len_q
        whole = whole and docs.bounds_k[1] - docs.bounds_k[0] == len_k
        self._whole = PreparedDense(impl, _doc_spec(spec, len_q, len_k), scale) if whole else None
        # documents with query rows by their (q, k) lengths; the key rows of documents
        # without any (their dK/dV rows are zero)
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._empty_q = []
        for (q0, q1), (k0, k1) in docs.pairs():
            if q1 == q0:
                self._empty_q.append((k0, k1 - k0))
            else:
                by_shape.setdefault((q1 - q0, k1 - k0), []).append((q0, k0))
        batching = spec.device.type == "cpu"
        self._documents = []  # (q0, n_q, k0, n_k, call): one call per document
        self._groups = []  # (q rows, k rows, call): one batched call per group
        for (n_q, n_k), starts in by_shape.items():
            if batching and len(starts) > 1:
                call = PreparedDense(impl, _doc_spec(spec, n_q, n_k, len(starts)), scale)
                q_rows = _DocumentRows([q0 for q0, _ in starts], n_q, spec.device)
                k_rows = _DocumentRows([k0 for _, k0 in starts], n_k, spec.device)
                self._groups.append((q_rows, k_rows, call))
            else:
                call = PreparedDense(impl, _doc_spec(spec, n_q, n_k), scale)
                self._documents.extend((q0, n_q, k0, n_k, call) for q0, k0 in starts)

    def forward(self, q, k, v):
        """q [1, Tq, H, D], k/v [1, Tk, Hkv, D] -> out [1, Tq, H, D], lse [1, H, Tq]."""
        if self._whole is not None:
            return self._whole.forward(q, k, v)
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = torch.empty((1, self._heads, q.shape[1]), dtype=self._acc, device=q.device)
        for q0, n_q, k0, n_k, call in self._documents:
            doc_out, doc_lse = call.forward(
                q.narrow(1, q0, n_q), k.narrow(1, k0, n_k), v.narrow(1, k0, n_k)
            )
            out.narrow(1, q0, n_q).copy_(doc_out)
            lse.narrow(2, q0, n_q).copy_(doc_lse)
        for q_rows, k_rows, call in self._groups:  # [G, n, h, D] batches of documents
            group_out, group_lse = call.forward(q_rows.take(q), k_rows.take(k), k_rows.take(v))
            q_rows.put(out, group_out)
            q_rows.put_lse(lse, group_lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse) -> Grads:
        """The gradients of :meth:`forward` (lse [1, H, Tq])."""
        if self._whole is not None:  # the kernel's gradients as they are
            return self._whole.backward(dout, q, k, v, out, lse)
        # contiguous whatever the inputs' strides: the groups' results are put by view
        dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
        for k0, n_k in self._empty_q:
            dk.narrow(1, k0, n_k).zero_()
            dv.narrow(1, k0, n_k).zero_()
        for q0, n_q, k0, n_k, call in self._documents:
            doc_dq, doc_dk, doc_dv = call.backward(
                dout.narrow(1, q0, n_q), q.narrow(1, q0, n_q), k.narrow(1, k0, n_k),
                v.narrow(1, k0, n_k), out.narrow(1, q0, n_q), lse.narrow(2, q0, n_q),
            )  # fmt: skip
            dq.narrow(1, q0, n_q).copy_(doc_dq)
            dk.narrow(1, k0, n_k).copy_(doc_dk)
            dv.narrow(1, k0, n_k).copy_(doc_dv)
        for q_rows, k_rows, call in self._groups:
            group_dq, group_dk, group_dv = call.backward(
                q_rows.take(dout), q_rows.take(q), k_rows.take(k), k_rows.take(v),
                q_rows.take(out), q_rows.take_lse(lse),
            )  # fmt: skip
            q_rows.put(dq, group_dq)
            k_rows.put(dk, group_dk)
            k_rows.put(dv, group_dv)
        return dq, dk, dv

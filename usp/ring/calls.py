"""The local kernel calls a ring step makes: dense blocks, or packed documents.

A ring call is validated once (``prepare_ring``); its :class:`BlockKernels` holds what
that resolved for the kernels: the softmax scale and, per block shape, the backend that
runs it and the block's spec, and per block shape a :class:`PreparedDense` call whose
decisions (empty rows, causal split, ``math`` fallback) are made once. The ring steps
then go straight to the kernels: no validation, no backend selection, no scale default
and no dispatch decision per block, layer or step. Packed calls on a backend without a
varlen kernel use one ``DocumentCalls`` per block shape (each document's call and rows
worked out once per batch, kept with its :class:`PackedDocs`).

:class:`DenseCalls` and :class:`PackedCalls` expose ``forward(q, k, v, causal) ->
(out, lse)`` and ``backward(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` on
[B, n, h, D] tensors, so the ring loops do not care whether the sequence is packed.
Packed calls take boundaries already on the device (:class:`PackedDocs`, built once per
batch).
"""

from __future__ import annotations

import dataclasses

import torch

from usp.kernels import ops
from usp.kernels.backends.base import Backend
from usp.kernels.backends.registry import KernelRegistry
from usp.kernels.dispatch import PreparedDense, docs_backward, docs_forward, document_calls
from usp.kernels.docs import DeviceBounds, PackedDocs
from usp.kernels.selection import select_backend
from usp.kernels.spec import AttentionSpec
from usp.ring.masked_window import masked_backward, masked_forward
from usp.ring.window import window_documents


class BlockKernels:
    """The kernel side of one validated ring call.

    ``template``: the call's spec (batch, heads, head dim, dtype, device); ``backend``:
    the requested name (``auto`` or a backend); ``scale``: the resolved softmax scale;
    ``registry``: where the names are looked up (None: usp's).
    :meth:`resolve` picks the backend of a block shape once and remembers it.
    """

    __slots__ = ("backend", "scale", "registry", "names", "_template", "_resolved", "_prepared")

    def __init__(
        self,
        template: AttentionSpec,
        backend: str,
        scale: float,
        registry: KernelRegistry | None = None,
    ):
        self.backend = backend
        self.scale = scale
        self.registry = registry
        #: the resolved backend's name per block key (what a compiled graph reads)
        self.names: dict[tuple, str] = {}
        self._template = template
        self._resolved: dict[tuple, tuple[Backend, AttentionSpec]] = {}
        self._prepared: dict[tuple, PreparedDense] = {}

    def resolve(
        self, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int, causal: bool, varlen: bool,
        window: int | None = None,
    ) -> tuple[Backend, AttentionSpec]:  # fmt: skip
        """(backend, spec) of a block; raises what ``select_backend`` raises. ``window``:
        the block's left window (spec.py's semantics), None for none."""
        key = (seqlen_q, seqlen_k, heads, kv_heads, causal, varlen, window)
        hit = self._resolved.get(key)
        if hit is None:
            spec = dataclasses.replace(
                self._template, batch=1 if varlen else self._template.batch, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, num_heads=heads, num_kv_heads=kv_heads, causal=causal,
                window=window, varlen=varlen,
            )  # fmt: skip
            hit = (select_backend(spec, self.backend, self.registry), spec)
            self._resolved[key] = hit
            self.names[key] = hit[0].name
        return hit

    def dense(
        self, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int, causal: bool,
        window: int | None = None,
    ):  # fmt: skip
        """The :class:`PreparedDense` call of a dense block shape, made once."""
        key = (seqlen_q, seqlen_k, heads, kv_heads, causal, window)
        prepared = self._prepared.get(key)
        if prepared is None:
            impl, spec = self.resolve(seqlen_q, seqlen_k, heads, kv_heads, causal, False, window)
            prepared = self._prepared[key] = PreparedDense(impl, spec, self.scale)
        return prepared


def backend_name(
    kernels: BlockKernels, shape: tuple, causal: bool, varlen: bool, window: int | None = None
) -> str:
    """The name of the backend a block shape resolved to when the call was prepared
    (``prepare_ring`` resolves every block shape): read, never resolved, while a graph
    is traced, so selection and its caches stay out of the graph."""
    return kernels.names[(*shape, causal, varlen, window)]


class DenseCalls:
    def __init__(self, kernels: BlockKernels):
        self.kernels = kernels

    def forward(self, q, k, v, causal, window=None, delta=0):
        """``window``: the block's left window; ``delta`` is only for packed blocks (a
        dense block's geometry is in its rows, :mod:`usp.ring.window`)."""
        if torch.compiler.is_compiling():  # one opaque op of the graph
            name = backend_name(self.kernels, _shape(q, k), causal, False, window)
            return ops.dense_forward_op(q, k, v, name, causal, self.kernels.scale, window)
        return self.kernels.dense(*_shape(q, k), causal, window).forward(q, k, v)

    def backward(self, dout, q, k, v, out, lse, causal, window=None, delta=0):
        if torch.compiler.is_compiling():
            name = backend_name(self.kernels, _shape(q, k), causal, False, window)
            scale = self.kernels.scale
            return ops.dense_backward_op(dout, q, k, v, out, lse, name, causal, scale, window)
        return self.kernels.dense(*_shape(q, k), causal, window).backward(dout, q, k, v, out, lse)


def _shape(q, k) -> tuple[int, int, int, int]:
    """(Sq, Sk, H, Hkv) of [B, S, h, D] blocks."""
    return q.shape[1], k.shape[1], q.shape[2], k.shape[2]


class PackedCalls:
    """Varlen calls with fixed document boundaries for q rows and k rows (batch 1): the
    backend's varlen kernel, or the ``DocumentCalls`` of the block shape (built
    once per batch, see :func:`usp.kernels.dispatch.document_calls`). Eagerly ``docs``
    is the batch's :class:`PackedDocs`; in a compiled graph its :class:`DeviceBounds`
    (the kernel ops read nothing else)."""

    def __init__(self, kernels: BlockKernels, docs: PackedDocs | DeviceBounds):
        self.kernels = kernels
        self.docs = docs

    def forward(self, q, k, v, causal, window=None, delta=0):
        """``window``: the left window of every document's call; ``delta`` > 0: the key
        piece's chunks are ``delta`` chunks before the query piece's in every document
        (a windowed block between pieces, one call per document, :mod:`usp.ring.window`)."""
        d, scale = self.docs, self.kernels.scale
        if window is not None and torch.compiler.is_compiling():  # masked from device bounds
            return masked_forward(q, k, v, d.cu_q, delta, window, scale)
        if delta:
            return window_documents(self.kernels, d, delta, window).forward(q, k, v)
        if torch.compiler.is_compiling():
            name = backend_name(self.kernels, _shape(q, k), causal, True)
            out, lse = ops.docs_forward_op(
                q[0], k[0], v[0], d.cu_q, d.cu_k, d.max_q, d.max_k, name, causal, scale
            )
            return out[None], lse[None]
        impl, spec = self.kernels.resolve(*_shape(q, k), causal, True, window)
        if impl.supports_varlen:
            out, lse = docs_forward(impl, q[0], k[0], v[0], d, spec, scale)
        else:
            return document_calls(impl, d, spec, scale).forward(q, k, v)
        return out[None], lse[None]

    def backward(self, dout, q, k, v, out, lse, causal, window=None, delta=0):
        d, scale = self.docs, self.kernels.scale
        if window is not None and torch.compiler.is_compiling():
            return masked_backward(dout, q, k, v, out, lse, d.cu_q, delta, window, scale)
        if delta:
            return window_documents(self.kernels, d, delta, window).backward(
                dout, q, k, v, out, lse
            )
        if torch.compiler.is_compiling():
            name = backend_name(self.kernels, _shape(q, k), causal, True)
            grads = ops.docs_backward_op(
                dout[0], q[0], k[0], v[0], out[0], lse[0], d.cu_q, d.cu_k, d.max_q, d.max_k,
                name, causal, scale,
            )  # fmt: skip
            return tuple(g[None] for g in grads)
        impl, spec = self.kernels.resolve(*_shape(q, k), causal, True, window)
        if impl.supports_varlen:
            grads = docs_backward(impl, dout[0], q[0], k[0], v[0], out[0], lse[0], d, spec, scale)
        else:
            return document_calls(impl, d, spec, scale).backward(dout, q, k, v, out, lse)
        return tuple(g[None] for g in grads)


def calls_for(cfg, docs: PackedDocs | DeviceBounds | None):
    """Dense calls, or packed calls over ``docs``, with the call's resolved kernels."""
    if docs is None:
        return DenseCalls(cfg.kernels)
    return PackedCalls(cfg.kernels, docs)

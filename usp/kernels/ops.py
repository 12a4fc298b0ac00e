"""The dispatcher's calls as ``torch.library`` ops, for ``torch.compile``.

Under compilation a kernel call is one opaque op of the graph (its fake implementation
gives the shapes), so what a backend does eagerly (the CPU kernel's non-finite detour,
the flash-attn generation, the split of causal Sq < Sk) never has to be traced. Eager
code calls the dispatcher directly (``usp.ring.calls`` switches on
``torch.compiler.is_compiling()``): an op call costs host time that eager runs do not
need to pay.

Outputs are contiguous (the fake implementations say so, and compiled graphs rely on
the strides they state). Packed calls pass the document boundaries as tensors and the
longest document as a ``SymInt`` (a symbolic size in a compiled graph), so one graph
serves every packing; a backend without a varlen kernel reads the boundaries on the
host (free on the CPU) and keeps its per-document calls per packing.

The ops are defined with ``torch.library.Library`` (schema, one implementation for every
device, a fake implementation), not ``torch.library.custom_op``, whose Python autograd
wrapper costs about 8 us of host time per call (12.9 against 4.9 us for an op that does
nothing, measured on this CPU): a compiled u1 x r8 layer call makes 16 of them, dense or
packed. They have no autograd formula: the ring calls them inside its autograd
function, where no gradient is recorded. What an implementation decides from its
arguments (the spec, the backend's per-shape decisions, a packing's per-document calls)
is made once per shape or packing and kept (``functools.lru_cache``, bounded): building
it at every call cost more host time than the dispatch.
"""

from __future__ import annotations

import functools

import torch

from usp.kernels.backends import registry
from usp.kernels.backends.base import Backend
from usp.kernels.dispatch import PreparedDense, docs_backward, docs_forward
from usp.kernels.docs import DeviceBounds, PackedDocs
from usp.kernels.masks import accumulation_dtype
from usp.kernels.spec import AttentionSpec

Tensor = torch.Tensor
_LIB = torch.library.Library("usp", "FRAGMENT")  # the ops of this package


@functools.lru_cache(maxsize=4096)
def _dense_call(
    impl: Backend, shape_q: torch.Size, shape_k: torch.Size, dtype: torch.dtype,
    device: torch.device, causal: bool, scale: float, window: int | None = None,
) -> PreparedDense:  # fmt: skip
    """The :class:`PreparedDense` call of a dense block shape (q [B, Sq, H, D], k
    [B, Sk, Hkv, D]), made once per process: a compiled graph calls the same few block
    shapes at every step and layer, and building a spec and its decisions per call cost
    more host time than the op dispatch itself. Holds no tensor."""
    batch, seqlen_q, heads, head_dim = shape_q
    spec = AttentionSpec(
        batch, seqlen_q, shape_k[1], heads, shape_k[2], head_dim, dtype, device, causal, window
    )  # fmt: skip
    return PreparedDense(impl, spec, scale)


@functools.lru_cache(maxsize=4096)
def _varlen_spec(
    shape_q: torch.Size, shape_k: torch.Size, dtype: torch.dtype, device: torch.device,
    causal: bool,
) -> AttentionSpec:  # fmt: skip
    """The spec of a packed call, q [Tq, H, D], k [Tk, Hkv, D] (made once per shape)."""
    tokens_q, heads, head_dim = shape_q
    return AttentionSpec(
        1, tokens_q, shape_k[0], heads, shape_k[1], head_dim, dtype, device, causal, None,
        varlen=True,
    )  # fmt: skip


def _lse_like(q: Tensor, varlen: bool) -> Tensor:
    shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(shape, dtype=accumulation_dtype(q.dtype))


# ------------------------------------------------------------------ dense
_LIB.define(
    "dense_forward(Tensor q, Tensor k, Tensor v, str backend, bool causal, float scale, "
    "int? window=None) -> (Tensor, Tensor)"
)
_LIB.define(
    "dense_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "str backend, bool causal, float scale, int? window=None) -> (Tensor, Tensor, Tensor)"
)


def _dense_forward(q, k, v, backend, causal, scale, window=None):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, H, D], lse [B, H, Sq];
    ``window``: the kernels' left window (spec.py), None for none."""
    impl = registry.get(backend)
    call = _dense_call(impl, q.shape, k.shape, q.dtype, q.device, causal, scale, window)
    out, lse = call.forward(q, k, v)
    return out.contiguous(), lse.contiguous()


def _dense_backward(dout, q, k, v, out, lse, backend, causal, scale, window=None):
    impl = registry.get(backend)
    call = _dense_call(impl, q.shape, k.shape, q.dtype, q.device, causal, scale, window)
    dq, dk, dv = call.backward(dout, q, k, v, out, lse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


_LIB.impl("dense_forward", _dense_forward, "CompositeExplicitAutograd")
_LIB.impl("dense_backward", _dense_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("usp::dense_forward", lib=_LIB)
def _(q, k, v, backend, causal, scale, window=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), _lse_like(q, False)


@torch.library.register_fake("usp::dense_backward", lib=_LIB)
def _(dout, q, k, v, out, lse, backend, causal, scale, window=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ------------------------------------------------------------------ packed documents
_LIB.define(
    "docs_forward(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, SymInt max_q, "
    "SymInt max_k, str backend, bool causal, float scale) -> (Tensor, Tensor)"
)
_LIB.define(
    "docs_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_q, Tensor cu_k, SymInt max_q, SymInt max_k, str backend, bool causal, "
    "float scale) -> (Tensor, Tensor, Tensor)"
)


@functools.lru_cache(maxsize=256)
def _boundaries(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], device) -> PackedDocs:
    """The :class:`PackedDocs` of a packing, built once per process: what a backend
    without a varlen kernel works out per block shape (its ``DocumentCalls``: each
    document's call, the rows of documents batched together) is kept in it, so that
    every layer and step of a batch, forward and backward, reuses it."""
    return PackedDocs.build(bounds_q, bounds_k, device)


def _docs(impl, cu_q: Tensor, cu_k: Tensor, max_q, max_k) -> PackedDocs | DeviceBounds:
    """What :func:`~usp.kernels.dispatch.docs_forward` needs of the documents: a varlen
    kernel reads the device boundaries as they are; one call per document needs them on
    the host (free for CPU tensors; on CUDA a device synchronisation, only for a backend
    without a varlen kernel, e.g. ``backend="cudnn"`` with packed documents)."""
    if impl.supports_varlen:
        return DeviceBounds(cu_q, cu_k, max_q, max_k)
    bounds_q = tuple(cu_q.tolist())
    bounds_k = bounds_q if cu_k is cu_q else tuple(cu_k.tolist())  # the ring's are one tensor
    return _boundaries(bounds_q, bounds_k, cu_q.device)


def _docs_forward(q, k, v, cu_q, cu_k, max_q, max_k, backend, causal, scale):
    """q [Tq, H, D], k/v [Tk, Hkv, D] -> out [Tq, H, D], lse [H, Tq]. ``max_q``/``max_k``:
    the longest document (a varlen kernel's grid); the boundaries are the tensors, so
    one graph serves every packing."""
    impl = registry.get(backend)
    spec = _varlen_spec(q.shape, k.shape, q.dtype, q.device, causal)
    docs = _docs(impl, cu_q, cu_k, max_q, max_k)
    out, lse = docs_forward(impl, q, k, v, docs, spec, scale)
    return out.contiguous(), lse.contiguous()


def _docs_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, backend, causal, scale):
    impl = registry.get(backend)
    spec = _varlen_spec(q.shape, k.shape, q.dtype, q.device, causal)
    docs = _docs(impl, cu_q, cu_k, max_q, max_k)
    dq, dk, dv = docs_backward(impl, dout, q, k, v, out, lse, docs, spec, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


_LIB.impl("docs_forward", _docs_forward, "CompositeExplicitAutograd")
_LIB.impl("docs_backward", _docs_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("usp::docs_forward", lib=_LIB)
def _(q, k, v, cu_q, cu_k, max_q, max_k, backend, causal, scale):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), _lse_like(q, True)


@torch.library.register_fake("usp::docs_backward", lib=_LIB)
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, backend, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


dense_forward_op = torch.ops.usp.dense_forward.default
dense_backward_op = torch.ops.usp.dense_backward.default
docs_forward_op = torch.ops.usp.docs_forward.default
docs_backward_op = torch.ops.usp.docs_backward.default

"""The dispatcher's calls as ``torch.library`` ops, for ``torch.compile``.

Under compilation a kernel call is one opaque op of the graph (its fake implementation
gives the shapes), so what a backend does eagerly (the CPU kernel's non-finite detour,
the flash-attn generation, the split of causal Sq < Sk) never has to be traced. Eager
code calls the dispatcher directly (``usp.ring.calls`` switches on
``torch.compiler.is_compiling()``): an op call costs host time that eager runs do not
need to pay.

Outputs are contiguous (the fake implementations say so, and compiled graphs rely on
the strides they state). Packed calls pass the document boundaries as int lists: a
compiled graph is specialised to them (a new packing recompiles).

The ops are defined with ``torch.library.Library`` (schema, one implementation for every
device, a fake implementation), not ``torch.library.custom_op``, whose Python autograd
wrapper costs about 8 us of host time per call (12.9 against 4.9 us for an op that does
nothing, measured on this CPU): a compiled u1 x r8 layer call makes 16 of them, a packed
one 68. They have no autograd formula: the ring calls them inside its autograd
function, where no gradient is recorded.
"""

from __future__ import annotations

import torch

from usp.kernels.backends import registry
from usp.kernels.dispatch import dense_backward, dense_forward, docs_backward, docs_forward
from usp.kernels.docs import PackedDocs
from usp.kernels.masks import accumulation_dtype
from usp.kernels.spec import AttentionSpec

Tensor = torch.Tensor
_LIB = torch.library.Library("usp", "FRAGMENT")  # the ops of this package


def _spec(q: Tensor, k: Tensor, causal: bool, varlen: bool) -> AttentionSpec:
    if varlen:  # q [Tq, H, D], k [Tk, Hkv, D]
        return AttentionSpec(
            1, q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device,
            causal, None, varlen=True,
        )  # fmt: skip
    return AttentionSpec(
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype,
        q.device, causal, None,
    )  # fmt: skip


def _lse_like(q: Tensor, varlen: bool) -> Tensor:
    shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(shape, dtype=accumulation_dtype(q.dtype))


# ------------------------------------------------------------------ dense
_LIB.define(
    "dense_forward(Tensor q, Tensor k, Tensor v, str backend, bool causal, float scale)"
    " -> (Tensor, Tensor)"
)
_LIB.define(
    "dense_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "str backend, bool causal, float scale) -> (Tensor, Tensor, Tensor)"
)


def _dense_forward(q, k, v, backend, causal, scale):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, H, D], lse [B, H, Sq]."""
    impl = registry.get(backend)
    out, lse = dense_forward(impl, q, k, v, _spec(q, k, causal, False), scale)
    return out.contiguous(), lse.contiguous()


def _dense_backward(dout, q, k, v, out, lse, backend, causal, scale):
    impl = registry.get(backend)
    grads = dense_backward(impl, dout, q, k, v, out, lse, _spec(q, k, causal, False), scale)
    return tuple(g.contiguous() for g in grads)


_LIB.impl("dense_forward", _dense_forward, "CompositeExplicitAutograd")
_LIB.impl("dense_backward", _dense_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("usp::dense_forward", lib=_LIB)
def _(q, k, v, backend, causal, scale):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), _lse_like(q, False)


@torch.library.register_fake("usp::dense_backward", lib=_LIB)
def _(dout, q, k, v, out, lse, backend, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ------------------------------------------------------------------ packed documents
_LIB.define(
    "docs_forward(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, int[] bounds_q, "
    "int[] bounds_k, str backend, bool causal, float scale) -> (Tensor, Tensor)"
)
_LIB.define(
    "docs_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_q, Tensor cu_k, int[] bounds_q, int[] bounds_k, str backend, bool causal, "
    "float scale) -> (Tensor, Tensor, Tensor)"
)


def _docs(cu_q: Tensor, cu_k: Tensor, bounds_q: list[int], bounds_k: list[int]) -> PackedDocs:
    return PackedDocs.build(bounds_q, bounds_k, cu_q.device, cu_q=cu_q, cu_k=cu_k)


def _docs_forward(q, k, v, cu_q, cu_k, bounds_q, bounds_k, backend, causal, scale):
    """q [Tq, H, D], k/v [Tk, Hkv, D] -> out [Tq, H, D], lse [H, Tq]."""
    docs = _docs(cu_q, cu_k, bounds_q, bounds_k)
    impl = registry.get(backend)
    out, lse = docs_forward(impl, q, k, v, docs, _spec(q, k, causal, True), scale)
    return out.contiguous(), lse.contiguous()


def _docs_backward(dout, q, k, v, out, lse, cu_q, cu_k, bounds_q, bounds_k, backend, causal, scale):
    docs = _docs(cu_q, cu_k, bounds_q, bounds_k)
    impl = registry.get(backend)
    spec = _spec(q, k, causal, True)
    grads = docs_backward(impl, dout, q, k, v, out, lse, docs, spec, scale)
    return tuple(g.contiguous() for g in grads)


_LIB.impl("docs_forward", _docs_forward, "CompositeExplicitAutograd")
_LIB.impl("docs_backward", _docs_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("usp::docs_forward", lib=_LIB)
def _(q, k, v, cu_q, cu_k, bounds_q, bounds_k, backend, causal, scale):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), _lse_like(q, True)


@torch.library.register_fake("usp::docs_backward", lib=_LIB)
def _(dout, q, k, v, out, lse, cu_q, cu_k, bounds_q, bounds_k, backend, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


dense_forward_op = torch.ops.usp.dense_forward.default
dense_backward_op = torch.ops.usp.dense_backward.default
docs_forward_op = torch.ops.usp.docs_forward.default
docs_backward_op = torch.ops.usp.docs_backward.default

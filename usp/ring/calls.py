"""The local kernel calls a ring step makes: dense blocks, or packed documents.

Both expose ``forward(q, k, v, causal) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` on [B, n, h, D] tensors, so
the ring loops do not care whether the sequence is packed. Packed calls take boundaries
already on the device (:class:`~usp.kernels.varlen.PackedDocs`, built once per batch).
"""

from __future__ import annotations

from usp.kernels import attention_backward, attention_forward
from usp.kernels.varlen import PackedDocs, packed_backward, packed_forward


class DenseCalls:
    def __init__(self, softmax_scale, backend):
        self.options = {"softmax_scale": softmax_scale, "backend": backend}

    def forward(self, q, k, v, causal):
        return attention_forward(q, k, v, causal=causal, **self.options)

    def backward(self, dout, q, k, v, out, lse, causal):
        return attention_backward(dout, q, k, v, out, lse, causal=causal, **self.options)


class PackedCalls:
    """Varlen calls with fixed document boundaries for q rows and k rows (batch 1)."""

    def __init__(self, softmax_scale, backend, docs: PackedDocs):
        self.options = {"softmax_scale": softmax_scale, "backend": backend}
        self.docs = docs

    def forward(self, q, k, v, causal):
        out, lse = packed_forward(q[0], k[0], v[0], self.docs, causal=causal, **self.options)
        return out[None], lse[None]

    def backward(self, dout, q, k, v, out, lse, causal):
        grads = packed_backward(
            dout[0], q[0], k[0], v[0], out[0], lse[0], self.docs, causal=causal, **self.options
        )
        return tuple(g[None] for g in grads)


def calls_for(cfg, docs: PackedDocs | None):
    """Dense calls, or packed calls over ``docs``, with the call's scale and backend."""
    if docs is None:
        return DenseCalls(cfg.softmax_scale, cfg.backend)
    return PackedCalls(cfg.softmax_scale, cfg.backend, docs)

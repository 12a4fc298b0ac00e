"""The interface every local attention backend implements.

A backend is called only for calls it said it supports (``unsupported_reason`` returned
None). Dense calls see the layout of ``spec.py``; a backend with
``bottom_right_causal = False`` is only given causal calls with Sq == Sk (the
dispatcher splits the others into a full block and a square causal block).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from usp.kernels.spec import AttentionSpec

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Backend:
    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]
    #: handles causal calls with Sq != Sk itself (bottom-right aligned)
    bottom_right_causal: ClassVar[bool] = False
    #: supports a left window (``spec.window``), any Sq/Sk
    supports_window: ClassVar[bool] = False
    #: has native variable-length (packed) entry points
    supports_varlen: ClassVar[bool] = False

    def unsupported_reason(self, spec: AttentionSpec) -> str | None:
        """None if this backend can run the call here, else a short reason."""
        if spec.device.type not in self.device_types:
            return f"runs on {'/'.join(self.device_types)}, not {spec.device.type}"
        if spec.window is not None and not self.supports_window:
            return "has no sliding-window support"
        return self.extra_unsupported_reason(spec)

    def extra_unsupported_reason(self, spec: AttentionSpec) -> str | None:
        return None

    # Dense: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, H, D], lse [B, H, Sq]
    def forward(
        self, q, k, v, spec: AttentionSpec, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, spec: AttentionSpec, scale: float) -> Grads:
        raise NotImplementedError

    # Varlen: q [Tq, H, D], k/v [Tk, Hkv, D], cu_seqlens int32 [N+1] -> out [Tq, H, D], lse [H, Tq]
    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, spec, scale):
        raise NotImplementedError

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale
    ) -> Grads:
        raise NotImplementedError

"""The interface every local attention backend implements (an interface only: selection
is ``usp.kernels.selection``, the self-check ``usp.kernels.selfcheck``, the dispatcher
that calls backends ``usp.kernels.dispatch``).

A backend is called only for calls it said it supports (``unsupported_reason`` returned
None). Dense calls see the layout of ``spec.py``. The dispatcher (``dispatch.py``) never gives
a backend a row that sees no key: causal calls with Sq > Sk have their leading rows cut
off first. A backend with ``bottom_right_causal = False`` is in addition only given causal
calls with Sq == Sk (the dispatcher splits Sq < Sk into a full block and a square causal
block), and a call with fewer than ``min_seqlen_k`` keys goes to ``math`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from usp.kernels.spec import AttentionSpec

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: (backend, spec) -> None or the reason it failed its self-check for the spec
SelfCheck = Callable[["Backend", AttentionSpec], "str | None"]


class BackendFailure(str):
    """A reason that is a failure, not a limit: the backend should run this call here but
    does not (it failed its self-check, or its kernel is missing from this build).

    ``auto`` warns about these (``warnings.warn`` and the ``usp.kernels`` logger) where it
    only logs a limit (dtype, head dim, window, a package that is not installed), and the
    tests fail on them where they skip a limit. ``transient`` failures (out of memory
    during the self-check) are not cached: the next call checks again.
    """

    transient: bool = False

    @classmethod
    def of(cls, text: str, *, transient: bool = False) -> BackendFailure:
        failure = cls(text)
        failure.transient = transient
        return failure


class Backend:
    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]
    #: handles causal calls with Sq < Sk itself (bottom-right aligned)
    bottom_right_causal: ClassVar[bool] = False
    #: supports a left window (``spec.window``), any Sq/Sk
    supports_window: ClassVar[bool] = False
    #: has native variable-length (packed) entry points
    supports_varlen: ClassVar[bool] = False
    #: fewest keys a kernel call may have; smaller calls (a short document, the full
    #: block of a split causal call) run on ``math``, whose cost is tiny there
    min_seqlen_k: ClassVar[int] = 1
    #: vetted against ``math`` by a run-time self-check before its first call for a
    #: (device, dtype, head_dim), see ``usp/kernels/selfcheck.py``
    self_checked: ClassVar[bool] = True

    def limits_reason(self, spec: AttentionSpec) -> str | None:
        """None if nothing this backend states rules the call out (device, window and
        :meth:`extra_unsupported_reason`), else a short reason. Whether it also passes
        its self-check is decided by ``usp.kernels.selection.unsupported_reason``."""
        if spec.device.type not in self.device_types:
            return f"runs on {'/'.join(self.device_types)}, not {spec.device.type}"
        if spec.window is not None and not self.supports_window:
            return "has no sliding-window support"
        return self.extra_unsupported_reason(spec)

    def extra_unsupported_reason(self, spec: AttentionSpec) -> str | None:
        return None

    def vet(self, spec: AttentionSpec, check: SelfCheck) -> str | None:
        """This backend's self-check verdict for the call: ``check(self, spec)`` (the
        cached run of :mod:`usp.kernels.selfcheck`). A backend with several
        implementations behind one name (flash_attn's FA3/FA2) vets each in turn."""
        return check(self, spec)

    def label(self, spec: AttentionSpec) -> str:
        """What runs, for logs and benchmark tables (e.g. which flash-attn generation)."""
        return self.name

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

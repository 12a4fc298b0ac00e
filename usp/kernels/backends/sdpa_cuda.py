"""PyTorch's CUDA SDPA kernels (cuDNN, FA2, memory-efficient) called through their aten
ops, which return the LSE and accept an external out/LSE in the backward.

(provisional: filled in from the research on the op semantics)
"""

from __future__ import annotations

from usp.kernels.backends.base import Backend


class _SdpaCudaBackend(Backend):
    device_types = ("cuda",)

    def extra_unsupported_reason(self, spec):
        return "is not implemented yet"


class CudnnBackend(_SdpaCudaBackend):
    name = "cudnn"


class FlashBackend(_SdpaCudaBackend):
    name = "flash"


class EfficientBackend(_SdpaCudaBackend):
    name = "efficient"


def make(name: str) -> Backend:
    return {"cudnn": CudnnBackend, "flash": FlashBackend, "efficient": EfficientBackend}[name]()

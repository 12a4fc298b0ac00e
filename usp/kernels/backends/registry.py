"""Backend names, instances and the ``auto`` preference order per device type.

:data:`DEFAULT` is usp's registry (what :func:`get` and :func:`auto_order` read). A
:class:`KernelRegistry` with some backends replaced (:meth:`KernelRegistry.replacing`)
can be handed to a :class:`usp.Plan` (``kernel_registry=``): the planner runs a step's
attention on its fake-tensor stand-ins that way, without touching this module."""

from __future__ import annotations

import torch

from usp.kernels.backends import flash_attn, sdpa_cuda
from usp.kernels.backends.base import Backend
from usp.kernels.backends.cpu import CpuBackend
from usp.kernels.backends.math import MathBackend
from usp.options import BACKEND_NAMES  # one source for the names

__all__ = ["BACKEND_NAMES", "DEFAULT", "KernelRegistry", "auto_order", "get"]

# Fastest first. On an H200 (torch 2.11, bf16, causal, head dim 128, fwd+bwd) cuDNN
# measured ~540 TFLOP/s, torch's FA2 ~325, memory-efficient ~140 (shared/DESIGN.md).
# The flash-attn package comes before torch's FA2: with FA3 installed it is the Hopper
# kernel, and its FA2 is the same kernel as torch's with more features.
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("cudnn", "flash_attn", "flash", "efficient", "math"),
    "cpu": ("cpu", "math"),
}


def auto_order(device: torch.device) -> tuple[str, ...]:
    return _AUTO_ORDER.get(device.type, ("math",))


def expected_backends(device_type: str) -> tuple[str, ...]:
    """The backends this build must be able to run on a device type: on CUDA every
    backend of torch itself, plus ``flash_attn`` when the package is installed. A
    backend listed here that refuses a call it should serve (a self-check failure, a
    kernel missing from the build) is a failure, not a skip, for tests and benchmarks."""
    if device_type == "cuda":
        optional = ("flash_attn",) if flash_attn.is_installed() else ()
        return ("cudnn", *optional, "flash", "efficient", "math")
    if device_type == "cpu":
        return ("cpu", "math")
    return ("math",)


def get(name: str) -> Backend:
    """The (stateless) backend instance for a name in usp's registry."""
    return DEFAULT.get(name)


class KernelRegistry:
    """Backend instances by name (every name of :data:`BACKEND_NAMES`). Immutable: a
    variant is a new registry (:meth:`replacing`)."""

    __slots__ = ("_backends",)

    def __init__(self, backends: dict[str, Backend]):
        missing = sorted(set(BACKEND_NAMES) - set(backends))
        unknown = sorted(set(backends) - set(BACKEND_NAMES))
        if missing or unknown:
            raise ValueError(
                f"a kernel registry holds exactly the backends {', '.join(BACKEND_NAMES)}; "
                f"missing {missing or 'none'}, unknown {unknown or 'none'}"
            )
        self._backends = dict(backends)

    def get(self, name: str) -> Backend:
        return self._backends[name]

    def replacing(self, backends: dict[str, Backend]) -> KernelRegistry:
        """This registry with the backends of some names replaced."""
        return KernelRegistry({**self._backends, **backends})


#: usp's backends
DEFAULT = KernelRegistry(
    {
        "math": MathBackend(),
        "cpu": CpuBackend(),
        **{name: sdpa_cuda.make(name) for name in ("cudnn", "flash", "efficient")},
        "flash_attn": flash_attn.FlashAttnBackend(),
    }
)

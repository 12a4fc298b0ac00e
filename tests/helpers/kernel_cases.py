"""Shared pieces of the kernel tests (tests/kernels/): which backends the build has, and
the skip-or-fail rule every kernel test applies before calling one."""

from __future__ import annotations

import pytest
import torch

from usp.kernels import AttentionSpec
from usp.kernels.backends import registry
from usp.kernels.backends.base import BackendFailure
from usp.kernels.selection import unsupported_reason


def devices():
    yield "cpu"
    if torch.cuda.is_available():
        yield "cuda"


BACKENDS = [(d, b) for d in devices() for b in registry.expected_backends(d)]
CUDA_BACKENDS = [b for d, b in BACKENDS if d == "cuda"]


def require(backend: str, spec: AttentionSpec) -> None:
    """Skip for a limit the backend states; fail when it should run this call but does
    not (a self-check failure, a kernel missing from the build)."""
    reason = unsupported_reason(registry.get(backend), spec)
    if isinstance(reason, BackendFailure):
        pytest.fail(f"backend {backend!r} must run {spec} but it {reason}")
    if reason is not None:
        pytest.skip(f"{backend} {reason}")


def work_dtype(device: str, backend: str) -> torch.dtype:
    """float32 where the backend runs it, else bfloat16 (cuDNN and the FA kernels)."""
    spec = AttentionSpec(1, 8, 8, 2, 2, 64, torch.float32, torch.device(device), True, None)
    reason = unsupported_reason(registry.get(backend), spec)
    return torch.bfloat16 if reason is not None and "float32" in reason else torch.float32

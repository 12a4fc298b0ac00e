"""What the CUDA backends share (torch's aten kernels in ``sdpa_cuda.py`` and the
flash-attn package in ``flash_attn.py``): the dtype/head-dim/GPU limits, the LSE
convention fix-up for rows that see no key, and op-schema probing."""

from __future__ import annotations

import functools

import torch

from usp.kernels.backends.base import Backend
from usp.kernels.spec import AttentionSpec

HALF = (torch.float16, torch.bfloat16)


def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def empty_rows_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """FA-style kernels write +inf for rows whose softmax sum is 0 (no visible key, or
    every score -inf) or NaN; usp's convention for the first is -inf, so merges ignore
    the block. A NaN row still carries its NaN in ``out``, which a merge propagates."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


@functools.cache
def op_schema_has(op_name: str, argument: str) -> bool:
    op = getattr(torch.ops.aten, op_name)
    return any(arg.name == argument for arg in op.default._schema.arguments)


class CudaBackend(Backend):
    """Limits shared by every CUDA backend: half dtypes, head_dim <= 256 in multiples of
    8, sm80 or newer; ``unsupported_here`` adds a backend's own."""

    device_types = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = HALF
    max_head_dim = 256
    head_dim_multiple = 8

    def extra_unsupported_reason(self, spec: AttentionSpec) -> str | None:
        if spec.dtype not in self.dtypes:
            return f"supports {', '.join(str(d) for d in self.dtypes)}, not {spec.dtype}"
        if spec.head_dim > self.max_head_dim or spec.head_dim % self.head_dim_multiple:
            return f"needs head_dim <= {self.max_head_dim} and a multiple of {self.head_dim_multiple}, got {spec.head_dim}"
        if capability(spec.device) < (8, 0):
            return "needs an sm80 (Ampere) or newer GPU"
        return self.unsupported_here(spec)

    def unsupported_here(self, spec: AttentionSpec) -> str | None:
        return None

"""Document boundaries of packed (varlen) calls, validated once and kept on the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from usp.kernels.spec import AttentionInputError


def _device_bounds(bounds, device: torch.device) -> torch.Tensor:
    """int32 boundaries on ``device``. On CUDA the copy goes through pinned memory with
    ``non_blocking``: it is queued on the stream instead of making the host wait for
    the work already queued there (a plain host-to-device copy would)."""
    host = torch.tensor(bounds, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class PackedDocs:
    """Validated document boundaries, ready for repeated varlen calls: build it once per
    batch and pass it to every layer's :func:`packed_forward`/:func:`packed_backward`.

    ``bounds_*`` are the Python boundaries (for per-document loops), ``cu_*`` the int32
    tensors on the compute device (for native varlen kernels), ``max_*`` the longest
    document: a call reads nothing back from the device and copies nothing to it.
    ``per_document`` holds what backends without a varlen kernel work out from the
    boundaries per call shape (:func:`usp.kernels.dispatch.document_calls`), so every
    layer of the batch, forward and backward, reuses it.
    """

    bounds_q: tuple[int, ...]
    bounds_k: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    per_document: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, bounds_q, bounds_k, device, *, cu_q=None, cu_k=None) -> PackedDocs:
        """From Python boundaries [0, ..., total]; ``cu_q``/``cu_k``, when given, are the
        same boundaries already on ``device`` (int32), reused instead of copied."""
        if len(bounds_q) != len(bounds_k):
            raise AttentionInputError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
                f"got {len(bounds_q) - 1} and {len(bounds_k) - 1}"
            )

        def on_device(given, bounds):
            usable = (
                given is not None
                and given.device == torch.device(device)
                and given.dtype == torch.int32
                and given.is_contiguous()
            )
            return given if usable else _device_bounds(bounds, device)

        longest = lambda b: max(y - x for x, y in zip(b, b[1:]))  # noqa: E731
        return cls(
            tuple(bounds_q),
            tuple(bounds_k),
            on_device(cu_q, bounds_q),
            on_device(cu_k, bounds_k),
            longest(bounds_q),
            longest(bounds_k),
        )

    def pairs(self):
        """((q0, q1), (k0, k1)) per document."""
        bq, bk = self.bounds_q, self.bounds_k
        return zip(zip(bq, bq[1:]), zip(bk, bk[1:]))


class DeviceBounds(NamedTuple):
    """Document boundaries as a compiled graph holds them: the int32 tensors on the
    device and the longest document as a symbolic size (no host values, so that one
    graph serves every packing of a shape). The compiled kernel calls take these."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

"""K/V ring messages at each tensor's own head size (MLA: q/k 192, v 128).

:func:`usp.sp.attend.pad_head_dims` zero-pads the smaller head size of k and v to the
larger after the Ulysses all-to-all, so the ring holds [2, ..., D] pairs (K and V, or dK
and dV) of one head size D. The padded columns are zeros and stay zeros (zero value
columns give zero output columns, whose gradient is zero, so dV's padded columns are
zero; zero q/k columns give zero dK/dQ columns), so a message need not carry them:
:func:`pack` sends ``K[..., :key_dim]`` and ``V[..., :value_dim]`` as one flat tensor and
:func:`unpack` rebuilds the padded pair on receipt. The same under ``torch.compile``:
plain tensor ops around the graph's functional collective (``usp.comm.traced``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVDims:
    """The real head sizes of K (``key_dim``) and V (``value_dim``) inside pairs padded
    to ``max(key_dim, value_dim)``. Code that may run in a compiled graph calls the
    module's :func:`pack` and :func:`unpack`, which read its fields: the graph holds it
    as a constant, whose methods Dynamo cannot call; the methods serve eager code."""

    key_dim: int
    value_dim: int

    def pack(self, pair: torch.Tensor) -> torch.Tensor:
        """:func:`pack` (eager code only)."""
        return pack(self, pair)

    def unpack(self, flat: torch.Tensor, shape, into: torch.Tensor | None = None):
        """:func:`unpack` (eager code only)."""
        return unpack(self, flat, shape, into)


def pack(dims: KVDims, pair: torch.Tensor) -> torch.Tensor:
    """[..., 2, *rest, D] -> [..., N]: K's and V's real columns, flat (leading dims
    kept: the all-gather packs every rank's share at once)."""
    lead = pair.shape[: pair.dim() - 5]
    first = pair.select(-5, 0)[..., : dims.key_dim]
    second = pair.select(-5, 1)[..., : dims.value_dim]
    return torch.cat([first.reshape(*lead, -1), second.reshape(*lead, -1)], -1)


def unpack(dims: KVDims, flat: torch.Tensor, shape, into: torch.Tensor | None = None):
    """:func:`pack`'s inverse: [..., N] -> [..., 2, *rest, D] of ``shape``, with zero
    padded columns (written into ``into`` when given)."""
    pair = torch.empty(shape, dtype=flat.dtype, device=flat.device) if into is None else into
    lead, rest = shape[: len(shape) - 5], shape[len(shape) - 4 : -1]
    key_dim, value_dim = dims.key_dim, dims.value_dim
    keys = flat.shape[-1] * key_dim // (key_dim + value_dim)
    for index, (part, dim) in enumerate(
        ((flat[..., :keys], key_dim), (flat[..., keys:], value_dim))
    ):
        half = pair.select(-5, index)
        half[..., :dim] = part.reshape(*lead, *rest, dim)
        half[..., dim:] = 0
    return pair


class PackedExchange:
    """A posted exchange of a packed pair: ``wait()`` gives the pair, padded again."""

    def __init__(self, pending, dims: KVDims, shape, into):
        self.pending, self.dims, self.shape, self.into = pending, dims, shape, into

    def wait(self) -> torch.Tensor:
        return unpack(self.dims, self.pending.wait(), self.shape, self.into)


def start_pair(ring, pair: torch.Tensor, dims: KVDims | None, into=None, hops: int = 1):
    """``ring.start(pair, into, hops)``, sending only the real columns when ``dims`` is
    given (and the pair is padded)."""
    if dims is None or dims.key_dim == dims.value_dim:
        return ring.start(pair, into, hops)
    return PackedExchange(ring.start(pack(dims, pair), None, hops), dims, pair.shape, into)

"""The functional API: each function is the matching :class:`usp.Plan` method, for a
plan made from its ``topology`` argument (a Plan or a Topology) and keyword overrides."""

from __future__ import annotations

import warnings

import torch

from usp.plan import as_plan


def _plan(topology, layout: str | None):
    return as_plan(topology, layout=layout)


def sequence_multiple(topology, layout: str | None = None) -> int:
    """What the global length of a dense sequence must be a multiple of."""
    return _plan(topology, layout).sequence_multiple


def shard_sequence(
    x: torch.Tensor, topology, *, dim: int = 1, layout: str | None = None, cu_seqlens=None
) -> torch.Tensor:
    """This rank's shard of ``x`` (the full sequence, identical on every SP rank) along
    ``dim``, in the order ``usp_attention`` expects (pass the same ``cu_seqlens`` for a
    packed sequence). Differentiable (an index_select)."""
    return _plan(topology, layout).shard(x, dim=dim, packed=cu_seqlens)


def gather_sequence(
    x_local: torch.Tensor, topology, *, dim: int = 1, layout: str | None = None, cu_seqlens=None
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence, on every SP rank (a
    collective over the SP group; no gradient)."""
    return _plan(topology, layout).gather(x_local, dim=dim, packed=cu_seqlens)


def local_token_indices(
    seq_len: int, topology, *, layout: str | None = None, cu_seqlens=None, device=None
) -> torch.Tensor:
    """Indices into the global sequence of the tokens this rank holds (int64, local order)."""
    return _plan(topology, layout).token_indices(seq_len, packed=cu_seqlens, device=device)


def local_position_ids(
    cu_seqlens: torch.Tensor | None,
    topology,
    *,
    seq_len: int | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """RoPE position ids of this rank's tokens (int64 [S/P], local order): positions
    inside each document of a packed sequence, or with ``cu_seqlens=None`` the global
    positions of a dense sequence of ``seq_len`` tokens."""
    plan = _plan(topology, layout)
    if cu_seqlens is None:
        if seq_len is None:
            raise ValueError("local_position_ids needs seq_len for a dense sequence")
        return plan.position_ids(seq_len)
    total = cu_seqlens.seq_len if hasattr(cu_seqlens, "seq_len") else int(cu_seqlens[-1])
    return plan.position_ids(total, packed=cu_seqlens)


def local_positions(seq_len: int, topology, *, layout=None, cu_seqlens=None, device=None):
    """Deprecated name of :func:`local_token_indices` (it is easily confused with
    :func:`local_position_ids`, the RoPE positions)."""
    warnings.warn(
        "usp.local_positions is renamed usp.local_token_indices",
        DeprecationWarning,
        stacklevel=2,
    )
    return local_token_indices(
        seq_len, topology, layout=layout, cu_seqlens=cu_seqlens, device=device
    )

"""USP attention: Ulysses all-to-all inside the node x ring attention across nodes.

    [B, S/P, H, D] --all-to-all (ulysses)--> [B, S/r, H/u, D]
                   --ring attention (ring)--> [B, S/r, H/u, D]
                   --all-to-all (ulysses)--> [B, S/P, H, D]

Inputs are this rank's shard in the layout of :mod:`usp.sharding` (``shard_sequence``
puts tokens there). With u = 1 or r = 1 the unneeded collectives are skipped entirely.
"""

from __future__ import annotations

import torch
from torch import nn

from usp.kernels.spec import validate_inputs
from usp.process_groups import Topology
from usp.ring import ring_attention
from usp.ring.config import RING_IMPLS
from usp.sharding import ShardingError, sequence_documents
from usp.ulysses import gather_heads, kv_replication_for, replicate_kv_heads, scatter_heads


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topology: Topology,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "zigzag",
    ring_impl: str = "p2p",
    backend: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the sequence sharded across ``topology``'s SP group.

    q [B, S/P, H, D], k/v [B, S/P, Hkv, D] (P = ulysses * ring) -> [B, S/P, H, D].
    ``cu_seqlens``: int32 document boundaries of the *global* packed sequence (B = 1,
    identical on every SP rank; shard with the same ``cu_seqlens``). Attention is then
    block-diagonal by document, causal inside each document when ``causal``.
    Bytes moved are counted in ``topology.comm_stats``.
    """
    spec = validate_inputs(q, k, v, causal=causal, window=None)
    if ring_impl not in RING_IMPLS:
        raise ValueError(f"unknown ring_impl {ring_impl!r}; valid: {', '.join(RING_IMPLS)}")
    u, r = topology.ulysses_degree, topology.ring_degree
    if cu_seqlens is not None and spec.batch != 1:
        raise ShardingError(f"packed sequences (cu_seqlens) need batch size 1, got {spec.batch}")
    try:
        sequence_documents(spec.seqlen_q * u * r, r, u, layout, cu_seqlens)
    except ShardingError as err:
        raise ShardingError(
            f"{err} (each rank holds {spec.seqlen_q} tokens of {u * r} ranks)"
        ) from None
    replication = kv_replication_for(
        spec.num_heads, spec.num_kv_heads, u, topology.sp_degree, topology.rank_map.ranks_per_node
    )
    stats = topology.comm_stats
    if u > 1:
        k, v = replicate_kv_heads(k, v, replication)
        q, k, v = gather_heads(q, k, v, topology.ulysses_group, stats)  # [B, S/r, h/u, D]
    out = ring_attention(
        q,
        k,
        v,
        topology.ring_group,
        causal=causal,
        softmax_scale=softmax_scale,
        layout=layout,
        ring_impl=ring_impl,
        backend=backend,
        comm_stats=stats,
        cu_seqlens=cu_seqlens,
    )
    if u > 1:
        out = scatter_heads(out, topology.ulysses_group, stats)  # [B, S/P, H, D]
    return out


class UspAttention(nn.Module):
    """``nn.Module`` form of :func:`usp_attention` (no parameters: it replaces the
    ``softmax(QK^T)V`` core of an attention layer, after projections and RoPE)."""

    def __init__(
        self,
        topology: Topology,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        layout: str = "zigzag",
        ring_impl: str = "p2p",
        backend: str = "auto",
    ):
        super().__init__()
        self.topology = topology
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.layout = layout
        self.ring_impl = ring_impl
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None
    ) -> torch.Tensor:
        return usp_attention(
            q,
            k,
            v,
            self.topology,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            layout=self.layout,
            ring_impl=self.ring_impl,
            backend=self.backend,
            cu_seqlens=cu_seqlens,
        )

    def extra_repr(self) -> str:
        t = self.topology
        return (
            f"ulysses={t.ulysses_degree}, ring={t.ring_degree}, causal={self.causal}, "
            f"layout={self.layout}, ring_impl={self.ring_impl}, backend={self.backend}"
        )

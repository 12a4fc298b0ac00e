"""The public front of USP attention: :func:`usp_attention` and :class:`UspAttention`.

Both build (or take) a :class:`usp.Plan` and call :meth:`usp.Plan.attention`; the
attention itself (Ulysses all-to-all x ring) is :mod:`usp.sp.attend`.
"""

from __future__ import annotations

import torch
from torch import nn

from usp.kernels.spec import AttentionInputError
from usp.sp.plan import as_plan


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str | None = None,
    ring_impl: str | None = None,
    backend: str | None = None,
    cu_seqlens=None,
    verify: bool | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the sequence sharded across the SP group.

    q [B, S/P, H, D], k/v [B, S/P, Hkv, D] (P = ulysses * ring) -> [B, S/P, H, D].
    ``plan``: a :class:`usp.Plan` (its layout, ring_impl and backend are the
    defaults) or a :class:`usp.process_groups.Topology` (defaults: zigzag, p2p, auto); the keyword
    arguments override them for this call. ``causal`` is False by default, as in
    ``torch.nn.functional.scaled_dot_product_attention`` and flash-attn.
    ``cu_seqlens``: int32 document boundaries of the *global* packed sequence (B = 1,
    identical on every SP rank; shard with the same ``cu_seqlens``), or the
    :class:`usp.sp.plan.PackedSequence` built once per batch by ``plan.pack`` (no host syncs).
    Attention is then block-diagonal by document, causal inside each document when
    ``causal``. ``verify``: agree on the call across the SP ranks before anything is sent
    (default: on for gloo, off for NCCL; see :mod:`usp.comm.call_check`).
    ``window``: a sliding window (an int >= 1, ``causal=True`` only): the query at
    position i of its document sees keys i-window+1 .. i, as transformers'
    ``sliding_window``; None is full attention.
    ``sinks``: attention sinks, a floating-point tensor [H] (one logit per query head,
    the whole tensor on every rank, as gpt-oss's ``sinks``), added to every row's softmax
    denominator as ``exp(sink)``; any dtype, computed in float32 (float64 for float64
    inputs). Its gradient on each rank covers that rank's rows: summed over the SP group
    (as FSDP sums gradients) it is the whole sequence's.
    Bytes moved are counted in ``plan.comm_stats`` (not inside a compiled graph).
    Second derivatives are refused. Under ``torch.compile(fullgraph=True)`` the call is
    one piece of the graph, its checks run while tracing (docs/architecture.md, *torch.compile*).
    """
    plan = as_plan(plan, layout=layout, ring_impl=ring_impl, backend=backend)
    return plan.attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, packed=cu_seqlens,
        verify=verify, window=window, sinks=sinks,
    )  # fmt: skip


class UspAttention(nn.Module):
    """``nn.Module`` form of :func:`usp_attention` (no parameters: it replaces the
    ``softmax(QK^T)V`` core of an attention layer, after projections and RoPE).
    ``plan``: a Plan or a Topology, as for the function. Defaults as the function:
    ``causal=False``. ``sinks`` (the module holds no parameter) go to ``forward``."""

    def __init__(
        self,
        plan,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        layout: str | None = None,
        ring_impl: str | None = None,
        backend: str | None = None,
        window: int | None = None,
    ):
        super().__init__()
        self.plan = as_plan(plan, layout=layout, ring_impl=ring_impl, backend=backend)
        if not isinstance(causal, bool):
            raise AttentionInputError(f"causal must be a bool, got {causal!r}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.window = window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None, sinks=None
    ) -> torch.Tensor:
        return self.plan.attention(
            q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, packed=cu_seqlens,
            window=self.window, sinks=sinks,
        )  # fmt: skip

    def extra_repr(self) -> str:
        p = self.plan
        return (
            f"ulysses={p.ulysses_degree}, ring={p.ring_degree}, causal={self.causal}, "
            f"window={self.window}, "
            f"layout={p.layout}, ring_impl={p.ring_impl}, backend={p.backend}"
        )

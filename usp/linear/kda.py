"""Kimi Delta Attention (KDA, Kimi-Linear's linear layer) under hybrid SP: Gated
DeltaNet's ring design with a decay per key channel.

:func:`kda_usp` takes a rank's sequence shard of the conv's inputs (or of q, k, v
directly), the per-channel log decay g and beta, and returns its shard of the
recurrence's output, exact (forward and backward) against one process. Per value head,
with a state S [dk, dv] and ``diag(exp(g_t))`` decaying each key channel's row::

    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

Every step is a left product of S by a [dk, dk] matrix plus a term in v, so a segment's
map from its start state is ``S_end = M S_start + B`` with M [dk, dk], as for Gated
DeltaNet: the same ring block (:func:`usp.linear.block.ring_block`): one all-to-all
(Ulysses: heads split, key heads repeated to lcm(Hk, u) when u does not divide them),
the conv's tails and the segments' maps by one all-gather each over the ring, the maps
composed in chunk order, the inverse all-to-all. Only the kernel differs
(:data:`usp.linear.backends.KDA_DEFAULT`: usp's torch kernel with the decay per channel,
fla's ``chunk_kda``), and g travels as [B, S/P, H, dk].

Traffic per rank and direction (the backward's reduce-scatters and all-to-alls move the
same; :func:`usp.planner.mixer_traffic.kda_traffic`): all-to-all (u > 1)
``(u-1)/u x T x [(2 Hk' dk + H dv) e + H (dk + 1) e_g + H dv e]``, all-gather (r > 1)
``(r-1) x B x N x [(K-1)(2 Hk' dk + H dv)/u + (H/u) dk (dk + dv)] e_c``: Gated DeltaNet's
with g's dk numbers per head in place of one.

Documents (``packed``) restart the conv and the state at every boundary. One process
(``plan`` None or of one rank) runs the same code without communication. Eager only:
under ``torch.compile`` the call is refused (Gated DeltaNet's is the compiled one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from usp.comm.agreement import float_bits
from usp.errors import InputError
from usp.linear.agreed import (
    ACTIVATIONS,
    COMMON_ERRORS,
    checked_call,
    choice_field,
    delta_rule_call,
    documents_field,
    dtype_field,
    eager_only,
    grad_field,
    shape_field,
)  # fmt: skip
from usp.linear.backends import GDN_KERNELS, GdnKernel, GdnKernelError, select_kda_kernel
from usp.linear.block import BlockOptions, RingPeers, ring_block
from usp.linear.choice import plan_choice
from usp.linear.conv import CONV_KERNELS, ConvKernel, ConvKernelError
from usp.linear.heads import delta_rule_heads
from usp.ring.documents import Documents
from usp.sp.ulysses import to_sequence_sharded

__all__ = ["KdaError", "kda_usp"]

_NAMES = ("q", "k", "v", "g", "beta", "wq", "wk", "wv")


class KdaError(InputError):
    """Inputs or options the Kimi Delta Attention path cannot compute."""


def kda_usp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan=None,
    *,
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: str | None = "silu",
    packed=None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    kernel: str | None = None,
    kernels=None,
    conv_kernel: str | None = None,
    conv_kernels=None,
) -> torch.Tensor:
    """The Kimi Delta Attention token mixer on this rank's sequence shard (exact under SP).

    q, k [B, S/P, Hk, dk]; v [B, S/P, H, dv]; g [B, S/P, H, dk] (the log decay of every
    key channel, <= 0: Kimi-Linear's ``-exp(A_log) softplus(f + dt_bias)``); beta
    [B, S/P, H]; in the plan's layout (:meth:`usp.Plan.shard`). ``conv_weights`` =
    (wq [Hk*dk, K], wk [Hk*dk, K], wv [H*dv, K]): q, k, v are the causal depthwise conv's
    inputs (no bias), then ``activation``; q and k l2-normalised (``use_qk_l2norm``), q
    scaled by ``scale`` (default dk**-0.5); value head e reads key head e // (H / Hk);
    the state restarts at every document of ``packed`` (cu_seqlens or a PackedSequence of
    ``plan``). Returns [B, S/P, H, dv] in v's dtype. ``plan``: a :class:`usp.Plan`, or
    None for one process. ``chunk_size``: the kernel's chunk length (work, not results;
    the torch kernel holds a [C, C, dk] decay per chunk, fla takes 32 or 64 and runs 64
    for any other). ``kernel``: ``"auto"`` (fla's ``chunk_kda`` on CUDA when installed
    and self-checked, else usp's torch kernel), ``"torch"`` or ``"fla"`` (``kernels``: a
    :class:`usp.linear.backends.GdnKernels` to look them up in); ``conv_kernel``:
    ``"auto"``, ``"torch"`` or ``"causal_conv1d"`` (``conv_kernels``: a dict); None: the
    plan's ``linear_backend`` / ``linear_conv_backend``.

    Raises :class:`KdaError` / ``UlyssesHeadError`` / ``ShardingError`` (and
    ``GdnKernelError`` / ``ConvKernelError`` for a kernel that cannot run) on every SP
    rank, before any data moves, for what it cannot compute.
    """
    eager_only("kda_usp", "KDA", KdaError, plan)
    u = 1 if plan is None else plan.ulysses_degree
    choices = (plan_choice(kernel, plan, "linear_backend"),
               plan_choice(conv_kernel, plan, "linear_conv_backend"))  # fmt: skip
    inputs = (q, k, v, g, beta)
    options = (conv_weights, activation, packed, scale, use_qk_l2norm, chunk_size)
    checked = checked_call(
        plan, "kda_usp",
        lambda: _check(inputs, options, plan, choices, kernels, conv_kernels),
        lambda checked: _fields(inputs, options, choices, checked),
        _ERRORS,
    )  # fmt: skip
    stats = None if plan is None else plan.comm_stats
    q, k, v_local, g, beta, ws = delta_rule_heads(
        q, k, v, g, beta, conv_weights, checked.times, None if u == 1 else plan.ulysses_group,
        stats, 0 if plan is None else plan.ulysses_rank, u,
    )  # fmt: skip
    ring = RingPeers.of(plan)
    block = BlockOptions(
        activation, scale, use_qk_l2norm, chunk_size, checked.kernel, checked.conv_kernel
    )
    out = ring_block([q, k, v_local, g, beta], checked.documents, ring, ws, block)
    if u > 1:  # [B, S/r, H/u, dv] -> [B, S/P, H, dv]
        out = to_sequence_sharded(out, plan.ulysses_group, stats)
    return out


@dataclass(frozen=True)
class _Checked:
    times: int  # each key head repeated before the all-to-all
    documents: Documents
    kernel: GdnKernel
    conv_kernel: ConvKernel | None


_ERRORS = (KdaError, GdnKernelError, ConvKernelError, *COMMON_ERRORS)


def _check_inputs(q, k, v, g, beta, conv_weights, activation, scale, use_qk_l2norm, chunk_size):
    named = dict(zip(_NAMES, (q, k, v, g, beta)))
    wrong = [
        n for n, t in named.items() if not (isinstance(t, torch.Tensor) and t.is_floating_point())
    ]
    if wrong:
        raise KdaError(f"{', '.join(wrong)} must be floating-point tensors")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise KdaError(
            f"q and k must be [B, S, Hk, dk] of one shape and v [B, S, H, dv]; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    heads, dk = v.shape[2], q.shape[3]
    if g.shape != (*v.shape[:3], dk) or beta.shape != v.shape[:3]:
        raise KdaError(
            f"g must be [B, S, H, dk] = {(*v.shape[:3], dk)} (a decay per key channel) and "
            f"beta [B, S, H] = {tuple(v.shape[:3])}; got g {tuple(g.shape)}, beta "
            f"{tuple(beta.shape)}"
        )
    if len({q.dtype, k.dtype, v.dtype}) != 1 or g.dtype != beta.dtype:
        raise KdaError(
            f"q, k, v must share a dtype and g, beta another; got {q.dtype}, {k.dtype}, "
            f"{v.dtype} and {g.dtype}, {beta.dtype}"
        )
    if heads % q.shape[2]:
        raise KdaError(f"{heads} value heads are not a multiple of {q.shape[2]} key heads")
    if activation not in ACTIVATIONS:
        raise KdaError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if type(chunk_size) is not int or chunk_size < 1:
        raise KdaError(f"chunk_size must be a positive int (e.g. 64), got {chunk_size!r}")
    if scale is not None and not (
        isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
        and scale > 0
    ):  # fmt: skip
        raise KdaError(f"scale must be a finite number > 0 or None (dk**-0.5), got {scale!r}")
    if not isinstance(use_qk_l2norm, bool):
        raise KdaError(f"use_qk_l2norm must be True or False, got {use_qk_l2norm!r}")
    if conv_weights is not None:
        expected = [q.shape[2] * dk, q.shape[2] * dk, heads * v.shape[3]]
        ws = list(conv_weights)
        if len(ws) != 3 or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in ws):
            raise KdaError("conv_weights must be (wq, wk, wv), each a [channels, kernel] tensor")
        if (
            [w.shape[0] for w in ws] != expected
            or len({w.shape[1] for w in ws}) != 1
            or (ws[0].shape[1] < 1)
        ):
            raise KdaError(
                f"conv_weights must be [channels, kernel] with channels {expected} and one "
                f"kernel size >= 1; got {[tuple(w.shape) for w in ws]}"
            )


def _check(inputs, options, plan, choices, kernels, conv_kernels) -> _Checked:
    """Everything that could fail on this rank (before the agreement)."""
    q, k, v, g, beta = inputs
    conv_weights, activation, packed, scale, use_qk_l2norm, chunk_size = options
    _check_inputs(q, k, v, g, beta, conv_weights, activation, scale, use_qk_l2norm, chunk_size)
    return _Checked(*delta_rule_call(
        q, k, v, conv_weights, plan, packed, (choices[0], kernels), (choices[1], conv_kernels),
        select=select_kda_kernel, what="KDA", entry="kda_usp", error=KdaError,
    ))  # fmt: skip


def _fields(inputs, options, choices, checked: _Checked | None):
    """What the SP ranks must agree on (whatever the inputs: never raises)."""
    conv_weights, activation, _, scale, use_qk_l2norm, chunk_size = options
    ws = list(conv_weights) if isinstance(conv_weights, (tuple, list)) else []
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    settings = [
        ACTIVATIONS.index(activation) if activation in ACTIVATIONS else -1,
        float_bits(scale) if number and math.isfinite(scale) else -1,
        use_qk_l2norm if isinstance(use_qk_l2norm, bool) else -1, chunk_size,
    ]  # fmt: skip
    return [
        shape_field("shapes of q, k, v, g, beta and the conv weights", [*inputs, *ws]),
        shape_field("activation, scale, use_qk_l2norm, chunk_size", settings),
        dtype_field("dtypes of q, k, v, g, beta", inputs),
        documents_field(None if checked is None else checked.documents),
        choice_field("KDA kernel (auto, torch or fla)", choices[0], GDN_KERNELS),
        choice_field("conv kernel (auto, torch or causal_conv1d)", choices[1], CONV_KERNELS),
        grad_field(_NAMES, [*inputs, *ws]),
    ]

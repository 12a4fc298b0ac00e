"""Gated DeltaNet under hybrid SP: Ulysses over heads x the ring's state pass.

:func:`gated_deltanet_usp` takes a rank's sequence shard of the conv's inputs (or of
q, k, v directly) and returns its shard of the recurrence's output, exact (forward and
backward) against one process:

1. Ulysses: one all-to-all trades sequence for heads ([B, S/P, H, D] -> [B, S/r, H/u, D])
   for q, k, v, g and beta together. Value heads split over u; key heads too, repeated
   ``lcm(Hk, u) / Hk`` times first when u does not divide them (as KV heads for GQA).
2. The rank's ring block is cut into segments (one chunk of one document each, see
   :mod:`usp.linear.ring`) and computed as a padded batch:
   - the causal depthwise conv reads each segment's left context: the last
     ``kernel - 1`` inputs before it in its document, from one all-gather of every
     segment's tail over the ring (zeros at a document's start);
   - the recurrence runs on every segment from the state [0 | I] (the value columns
     extended by d_k identity columns): the first d_v output columns are the output from
     a zero state, the others ``q~ = P^T q`` (P the transition from the segment's start),
     and the final state holds the segment's affine map (B, M). One all-gather of the
     maps over the ring; every rank composes them in chunk order into its segments'
     start states S0, and adds ``q~ S0`` to the outputs.
3. The inverse all-to-all returns [B, S/P, H, dv].

The conv and the recurrence run on the kernels chosen per call (``kernel=``,
``conv_kernel=``; by default the plan's ``linear_backend`` / ``linear_conv_backend``,
:mod:`usp.linear.choice`): usp's torch code, or on CUDA the ``usp[fla]`` packages
(:mod:`usp.linear.backends`, :mod:`usp.linear.conv`), self-checked before first use.

No rank waits for another's recurrence: the ring costs two all-gathers whose size does
not depend on S (per rank and direction, (r - 1) x segments x B x (the conv tails
(kernel - 1) x channels/u + the maps H/u x dk x (dk + dv))), and d_k extra value columns
in the kernel (about 2x its work for dk = dv), paid only when r > 1. The backward is
autograd's: the all-gathers' backward is a reduce-scatter of the same size.

Documents (``packed``) restart the conv and the state at every boundary. One process
(``plan`` None or of one rank) runs the same code without communication.

Under ``torch.compile`` (``fullgraph=True``) the call is checked, and the SP ranks agree
on it, once per call shape while Dynamo traces (:func:`traced_gdn`); the graph holds the
all-to-alls (functional collectives) and step 2 as one opaque op whose only packing
input is the boundaries' tensor (:mod:`usp.linear.compiled`: one graph for every
packing; its backward recomputes the block). Packed documents must then come as a
:class:`PackedSequence` built outside the graph (``plan.pack``), with usp's kernels
(``kernels=`` / ``conv_kernels=`` registries are eager-only).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.agreement import agree, can_agree
from usp.comm.traced import TracedGroup
from usp.compile_marks import constant_result
from usp.errors import InputError, ShardingError
from usp.linear.backends import GdnKernel, GdnKernelError, select_gdn_kernel
from usp.linear.block import BlockOptions, RingPeers, ring_block
from usp.linear.choice import GDN_HEADS, plan_choice
from usp.linear.compiled import gdn_ring_block
from usp.linear.conv import ConvKernel, ConvKernelError, select_conv_kernel
from usp.linear.gdn_checks import (
    LinearAttentionError,
    agreed_fields,
    check_inputs,
    inputs_grad_mask,
)
from usp.linear.heads import (
    documents_of,
    rank_channels,
    replicated_channels,
    to_head_sharded_by_dtype,
)  # fmt: skip
from usp.process_groups import HeadLayoutError, degrees
from usp.ring.documents import Documents
from usp.sp.attend import stand_in_packed
from usp.sp.packing import PackedSequence
from usp.sp.placed import run_placed, shard_packing_or_error
from usp.sp.ulysses import UlyssesHeadError, to_sequence_sharded

__all__ = ["LinearAttentionError", "gated_deltanet_usp"]


def gated_deltanet_usp(
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
    """The Gated DeltaNet token mixer on this rank's sequence shard (exact under SP).

    q, k [B, S/P, Hk, dk]; v [B, S/P, H, dv]; g (log decay) and beta [B, S/P, H], in the
    plan's layout (:meth:`usp.Plan.shard`). With ``conv_weights`` = (wq [Hk*dk, K],
    wk [Hk*dk, K], wv [H*dv, K]) q, k, v are the conv's inputs: each channel is convolved
    causally (kernel K, no bias) and ``activation`` applied (transformers' Qwen3.5
    channel order: channel h*dk + i is head h, dim i). Then q and k are l2-normalised
    (``use_qk_l2norm``), q scaled by ``scale`` (default dk**-0.5), and the gated delta
    rule run per value head (value head e reads key head e // (H / Hk)); its state
    restarts at every document of ``packed`` (cu_seqlens or a PackedSequence of ``plan``).
    Returns [B, S/P, H, dv] in v's dtype. ``plan``: a :class:`usp.Plan`, or None for one
    process. ``chunk_size``: the kernel's chunk length (work, not results; fla takes 16,
    32 or 64 and runs 64 for any other). ``kernel``: ``"auto"`` (fla on CUDA when
    installed and self-checked, else usp's torch kernel), ``"torch"`` or ``"fla"`` (see
    :mod:`usp.linear.backends`; ``kernels``: a :class:`GdnKernels` to look them up in,
    default usp's); None (default): the plan's ``linear_backend`` (``"auto"`` without a
    plan). ``conv_kernel``: the short conv's, ``"auto"`` (causal-conv1d on CUDA when
    installed and self-checked, else torch's conv1d), ``"torch"`` or ``"causal_conv1d"``
    (see :mod:`usp.linear.conv`; ``conv_kernels``: a dict of them); None: the plan's
    ``linear_conv_backend``.

    Raises :class:`LinearAttentionError` / ``UlyssesHeadError`` / ``ShardingError`` (and
    ``GdnKernelError`` / ``ConvKernelError`` for a kernel that cannot run) on every SP
    rank, before any data moves, for what it cannot compute.
    """
    options = (conv_weights, activation, packed, scale, use_qk_l2norm, chunk_size, kernel,
               kernels, conv_kernel, conv_kernels)  # fmt: skip
    if packed is not None and getattr(plan, "placement", None) == "documents":
        return _placed(q, k, v, g, beta, plan, options)
    if torch.compiler.is_compiling():
        return _compiled(q, k, v, g, beta, plan, *options)
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree
    grad = inputs_grad_mask(q, k, v, g, beta, conv_weights)
    checked = _checked(
        q, k, v, g, beta, plan, conv_weights, activation, packed, scale, use_qk_l2norm,
        chunk_size, kernel, kernels, conv_kernel, conv_kernels, grad,
    )  # fmt: skip
    stats = None if plan is None else plan.comm_stats
    ulysses = None if u == 1 else plan.ulysses_group
    q, k, v_local, g, beta, ws = _to_heads(
        q, k, v, g, beta, conv_weights, checked.times, ulysses, stats,
        0 if plan is None else plan.ulysses_rank, u,
    )  # fmt: skip
    ring = RingPeers(
        None if r == 1 else plan.ring_group, stats, 0 if plan is None else plan.ring_rank
    )
    options = BlockOptions(
        activation, scale, use_qk_l2norm, chunk_size, checked.kernel, checked.conv_kernel
    )
    out = ring_block([q, k, v_local, g, beta], checked.documents, ring, ws, options)
    if u > 1:  # [B, S/r, H/u, dv] -> [B, S/P, H, dv]
        out = to_sequence_sharded(out, ulysses, stats)
    return out


def _placed(q, k, v, g, beta, plan, options) -> torch.Tensor:
    """placement="documents" (:mod:`usp.sp.placed`): the split documents' rows under SP,
    the rank's whole documents in one process (the plan's ``whole_plan``, same kernels),
    concatenated."""
    if torch.compiler.is_compiling():
        raise LinearAttentionError(
            "placement='documents' runs eagerly: call it without torch.compile"
        )
    conv_weights, activation, packed, *rest = options
    placed, error = shard_packing_or_error(plan, packed, v.shape[1], v.device, _ERRORS)
    names = ("scale", "use_qk_l2norm", "chunk_size", "kernel", "kernels", "conv_kernel",
             "conv_kernels")  # fmt: skip
    keywords = dict(zip(names, rest), conv_weights=conv_weights, activation=activation)

    def call(part_plan, parts, part):
        return gated_deltanet_usp(*parts, part_plan, packed=part, **keywords)

    def check_whole(parts):
        grad = inputs_grad_mask(*parts, conv_weights)
        _checked(*parts, plan.whole_plan, conv_weights, activation, placed.whole, *rest, grad)

    return run_placed(
        plan, placed, [q, k, v, g, beta], call, what="gated_deltanet_usp (whole documents)",
        check_whole=check_whole, errors=_ERRORS, verify=None, error=error,
    )  # fmt: skip


@dataclass(frozen=True)
class _Checked:
    """A call checked on this rank and agreed by the SP ranks: the key heads' repeat
    before the all-to-all, the documents' placement, the chosen kernels."""

    times: int
    documents: Documents
    kernel: GdnKernel
    conv_kernel: ConvKernel | None


def _checked(
    q, k, v, g, beta, plan, conv_weights, activation, packed, scale, use_qk_l2norm,
    chunk_size, kernel, kernels, conv_kernel, conv_kernels, grad: int,
) -> _Checked:  # fmt: skip
    """Everything that could fail, checked on this rank and agreed across the SP ranks
    (the same error on every rank) before the first collective (:mod:`usp.linear.
    gdn_checks`); ``grad``: which inputs require grad (a grad mask, agreed too)."""
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree
    kernel = plan_choice(kernel, plan, "linear_backend")
    conv_kernel = plan_choice(conv_kernel, plan, "linear_conv_backend")
    error, documents, times, impl, conv_impl = None, None, 1, None, None
    try:
        check_inputs(q, k, v, g, beta, conv_weights, activation, chunk_size, scale)
        if not isinstance(use_qk_l2norm, bool):
            raise LinearAttentionError(
                f"use_qk_l2norm must be True or False, got {use_qk_l2norm!r}"
            )
        times = degrees.kv_replication_for(
            v.shape[2], q.shape[2], u, u * r, error=UlyssesHeadError, names=GDN_HEADS,
            subject=f"cannot split {v.shape[2]} GDN value heads / {q.shape[2]} key heads "
            f"over ulysses={u}",
        )  # fmt: skip
        documents = documents_of(plan, v.shape[1] * u * r, packed)
        dk, dv = q.shape[3], v.shape[3]
        if documents.chunks_per_doc > 1:  # the ring's state pass adds d_k value columns
            dv += dk
        impl = select_gdn_kernel(kernel, v.device, v.dtype, dk, dv, kernels)
        if conv_weights is not None:  # this rank's channels: its heads after the all-to-all
            channels = (2 * q.shape[2] * times * q.shape[3] + v.shape[2] * v.shape[3]) // u
            width = conv_weights[0].shape[1]
            conv_impl = select_conv_kernel(
                conv_kernel, v.device, v.dtype, channels, width, conv_kernels
            )
        if r > 1 and dist.get_rank(plan.ring_group) != plan.ring_rank:
            raise LinearAttentionError(
                f"the ring group orders its ranks differently from the ring rank "
                f"({dist.get_rank(plan.ring_group)} != {plan.ring_rank}); gated_deltanet_usp "
                "reads the gathered chunks in ring-rank order"
            )
    except (InputError, HeadLayoutError) as err:
        error = err
    if plan is not None and plan.sp_degree > 1 and can_agree(plan.sp_group):
        fields = agreed_fields(
            (q, k, v, g, beta), conv_weights, activation, chunk_size, scale, use_qk_l2norm,
            documents, (kernel, conv_kernel), grad,
        )  # fmt: skip
        agree(plan.sp_group, "gated_deltanet_usp", fields, error, _ERRORS)
    if error is not None:
        raise error
    return _Checked(times, documents, impl, conv_impl)


_ERRORS = (
    LinearAttentionError, GdnKernelError, ConvKernelError, UlyssesHeadError, HeadLayoutError,
    ShardingError, InputError,
)  # fmt: skip


def _to_heads(q, k, v, g, beta, conv_weights, times, ulysses, stats, ulysses_rank, u):
    """[B, S/P, h, D] -> [B, S/r, h/u, D] (q, k with their key heads repeated ``times``
    first) and this Ulysses rank's conv weights (None without a conv). ``ulysses``: the
    group, its TracedGroup in a compiled graph, or None (u = 1)."""
    if times > 1:  # key heads repeated so that u ranks split them
        q, k = (t.repeat_interleave(times, dim=2) for t in (q, k))
    ws = None
    if conv_weights is not None:  # the key heads' channels repeated as the heads are
        ws = [*replicated_channels(conv_weights[:2], q.shape[2] // times, times), conv_weights[2]]
    tensors = [q, k, v, g[..., None], beta[..., None]]
    if u > 1:
        tensors = to_head_sharded_by_dtype(tensors, ulysses, stats)
        if ws is not None:
            ws = rank_channels(ws, u, ulysses_rank)
    q, k, v, g, beta = tensors
    return q, k, v, g[..., 0], beta[..., 0], ws


# ------------------------------------------------------------------ compiled graphs
@dataclass(frozen=True)
class TracedGdn:
    """A call checked while a compiled graph is traced (a constant of the graph): the
    key heads' repeat, the Ulysses group as its functional collectives take it (None
    when u = 1), and the values the ring block's op takes (:mod:`usp.linear.compiled`)."""

    times: int
    ulysses: TracedGroup | None
    ulysses_rank: int
    ring_group: str  # "" for a ring of one
    ring_rank: int
    ring_size: int
    layout: str
    kernel: str
    conv_kernel: str


def _compiled(
    q, k, v, g, beta, plan, conv_weights, activation, packed, scale, use_qk_l2norm,
    chunk_size, kernel, kernels, conv_kernel, conv_kernels,
) -> torch.Tensor:  # fmt: skip
    """:func:`gated_deltanet_usp` inside a compiled graph: the checks (and the SP ranks'
    agreement) run once per call shape while Dynamo traces (:func:`traced_gdn`); the
    graph holds the Ulysses all-to-alls and the ring block's op, which takes the
    packing's boundaries as a tensor (one graph for every packing)."""
    plan_type = topology = choices = None
    if plan is not None:  # a plan's identity is no constant: its class, topology, choices
        plan_type, topology = type(plan), plan.topology
        choices = (plan.layout, plan.ring_impl, plan.backend, plan.verify_calls)
    packed_sig = None
    if packed is not None and not isinstance(packed, PackedSequence):
        packed_sig = "raw"  # refused while tracing
    elif packed is not None:
        packed_sig = (
            "shape", operator.index(packed.seq_len), packed.ring_degree, packed.ulysses_degree,
            packed.layout, packed.placement.device, packed.placement.packed,
        )  # fmt: skip
    ws_sig = None if conv_weights is None else tuple(_signature(w) for w in conv_weights)
    tensors = tuple(_signature(t) for t in (q, k, v, g, beta))
    call = traced_gdn(
        plan_type, topology, choices, tensors, ws_sig, activation, packed_sig, scale,
        use_qk_l2norm, chunk_size, kernel, conv_kernel,
        kernels is not None or conv_kernels is not None,
        inputs_grad_mask(q, k, v, g, beta, conv_weights),
    )  # fmt: skip
    u = 1 if call.ulysses is None else call.ulysses.size
    q, k, v_local, g, beta, ws = _to_heads(
        q, k, v, g, beta, conv_weights, call.times, call.ulysses, None, call.ulysses_rank, u
    )
    out = gdn_ring_block(
        q, k, v_local, g, beta, [] if ws is None else ws,
        None if packed is None else packed.cu_seqlens, v.shape[1] * u * call.ring_size,
        call.layout, call.ring_group, call.ring_rank, call.ring_size, u, activation,
        None if scale is None else float(scale), bool(use_qk_l2norm), chunk_size, call.kernel,
        call.conv_kernel,
    )  # fmt: skip
    if u > 1:  # [B, S/r, H/u, dv] -> [B, S/P, H, dv]
        out = to_sequence_sharded(out, call.ulysses)
    return out


def _signature(x):
    """What the checks read of a tensor, as constants of the graph (shape, dtype, device);
    anything else as itself (the checks refuse it)."""
    if not isinstance(x, torch.Tensor):
        return x
    return tuple(operator.index(n) for n in x.shape), x.dtype, x.device


def _stand_in(signature):
    if not isinstance(signature, tuple):
        return signature
    shape, dtype, device = signature
    return torch.empty((), dtype=dtype, device=device).expand(shape)


@constant_result
def traced_gdn(
    plan_type, topology, choices, tensors, ws_sig, activation, packed_sig, scale,
    use_qk_l2norm, chunk_size, kernel, conv_kernel, own_kernels, grad=0,
) -> TracedGdn:  # fmt: skip
    """The checked call of a compiled graph, run eagerly while Dynamo traces: the eager
    checks and agreement (:func:`_checked`) on stand-ins of the tensors (``tensors``: the
    shape, dtype and device of q, k, v, g, beta; no data) and of the packing (one of its
    shape: the documents themselves reach the graph as a tensor), once per plan and call
    shape (kept in the plan's ``traced_calls``). A failed check fails the trace with its
    message, on every SP rank alike."""
    if own_kernels:
        raise LinearAttentionError(
            "kernels= and conv_kernels= (kernel registries of your own) are not taken under "
            "torch.compile; pass kernel=/conv_kernel= names, or call gated_deltanet_usp eagerly"
        )
    if packed_sig == "raw":
        raise LinearAttentionError(
            "under torch.compile, packed documents must be a PackedSequence built outside the "
            "compiled call (plan.pack(cu_seqlens)): raw cu_seqlens would be read on the host "
            "inside the graph"
        )
    plan = None if plan_type is None else plan_type.lasting(topology, *choices)
    key = ("gated_deltanet_usp", tensors, ws_sig, activation, packed_sig, scale, use_qk_l2norm,
           chunk_size, kernel, conv_kernel, grad)  # fmt: skip
    call = None if plan is None else plan.traced_calls.get(key)
    if call is None:
        call = _traced_call(plan, tensors, ws_sig, activation, packed_sig, scale,
                            use_qk_l2norm, chunk_size, kernel, conv_kernel, grad)  # fmt: skip
        if plan is not None:
            plan.traced_calls.put(key, call)
    return call


def _traced_call(
    plan, tensors, ws_sig, activation, packed_sig, scale, use_qk_l2norm, chunk_size, kernel,
    conv_kernel, grad,
) -> TracedGdn:  # fmt: skip
    """:func:`traced_gdn`'s checks, on stand-ins, and what the graph takes from them."""
    q, k, v, g, beta = (_stand_in(s) for s in tensors)
    ws = None if ws_sig is None else [_stand_in(s) for s in ws_sig]
    packed = None if packed_sig is None or plan is None else stand_in_packed(plan, packed_sig)
    checked = _checked(
        q, k, v, g, beta, plan, ws, activation, packed, scale, use_qk_l2norm, chunk_size,
        kernel, None, conv_kernel, None, grad,
    )  # fmt: skip
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree
    return TracedGdn(
        checked.times, None if u == 1 else TracedGroup.of(plan.ulysses_group),
        0 if plan is None else plan.ulysses_rank,
        "" if r == 1 else plan.ring_group.group_name, 0 if plan is None else plan.ring_rank, r,
        "contiguous" if plan is None else plan.layout, checked.kernel.name,
        "torch" if checked.conv_kernel is None else checked.conv_kernel.name,
    )  # fmt: skip

"""USP attention: Ulysses all-to-all inside the node x ring attention across nodes.

    [B, S/P, H, D] --all-to-all (ulysses)--> [B, S/r, H/u, D]
                   --ring attention (ring)--> [B, S/r, H/u, D]
                   --all-to-all (ulysses)--> [B, S/P, H, D]

Inputs are this rank's shard in the plan's layout (``plan.shard`` puts tokens there).
With u = 1 or r = 1 the unneeded collectives are skipped entirely. Every check happens
before the first collective (and, with ``verify``, the SP ranks agree on the call), so an
error leaves every process group usable. A call is validated once (:func:`check_call`):
the result holds the KV replication and the ring's validated call, whose kernels are
resolved per block shape; nothing is validated again per block, step or backward.

This module sits below :mod:`usp.sp.plan`: :func:`attend` reads the pieces it needs from
the plan it is given (degrees, groups, options, ``packed_sequence``) and imports no plan.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from usp.comm.call_check import checked_call, grad_mask
from usp.comm.traced import TracedGroup
from usp.compile_marks import constant_result
from usp.kernels.spec import AttentionInputError, validate_inputs
from usp.options import layout_chunks
from usp.process_groups import HeadLayoutError
from usp.ring.api import RING_ERRORS, prepare_ring, ring_placement, run_ring
from usp.ring.config import PreparedRing
from usp.ring.kv_message import KVDims
from usp.ring.partial import check_partial
from usp.sp.call_args import attention_fields, check_sinks, check_window, kernel_window
from usp.sp.packing import PackedSequence, PlanError, check_packed_fits
from usp.sp.sharding import ShardingError, check_sequence_length
from usp.sp.ulysses import (
    kv_replication_for,
    replicate_kv_heads,
    to_head_sharded,
    to_sequence_sharded,
)

#: errors a rank may raise while checking a call; shared with the other SP ranks
USP_ERRORS = (*RING_ERRORS, ShardingError, HeadLayoutError, PlanError)


@dataclass(frozen=True)
class CheckedCall:
    """A validated USP attention call: KV heads replication before the all-to-all, and
    the ring's validated call (its kernels resolved once); for a compiled graph, the
    Ulysses group as the values its functional collectives take (None when u = 1)."""

    kv_replication: int
    ring: PreparedRing
    ulysses: TracedGroup | None = None
    #: the query heads this rank attends to after the all-to-all (the slice of ``sinks``)
    heads: tuple[int, int] = (0, 0)


def _check_segments(plan, has_segments: bool) -> None:
    """A PackedSequence without all-gather indices cannot serve an all-gather ring."""
    if plan.ring_impl == "allgather" and plan.ring_degree > 1 and not has_segments:
        raise PlanError(
            "this PackedSequence was packed by a plan with ring_impl='p2p', so it holds no "
            "all-gather indices; pack it with the plan that attends (ring_impl='allgather')"
        )


def check_call(
    plan, q, k, v, causal, softmax_scale, packed, head_chunks=1, sinks=None, window=None,
    compiled=False, partial=None,
) -> CheckedCall:  # fmt: skip
    """Everything that could fail, checked on this rank before anything is sent
    (``compiled``: while a compiled graph is traced)."""
    spec = validate_inputs(*_padded_stand_ins(q, k, v), causal=causal, window=None)
    check_sinks(sinks, spec)
    value_dim = v.shape[-1] if isinstance(v, torch.Tensor) else -1
    check_partial(partial, spec, value_dim, eager=not compiled, mla=mla_dims(q, k, v) is not None)
    check_window(window, causal)
    if (
        compiled and window is not None and packed is not None
        and plan.ring_impl != "p2p" and plan.ring_degree > 1
    ):  # fmt: skip
        # the all-gather ring gathers each document's windowed rows, sized by the
        # packing's host ints: a graph would be specialised to one packing (the p2p
        # ring masks its windowed blocks from device bounds, usp.ring.masked_window)
        raise AttentionInputError(
            f"window={window} with packed documents is not supported under torch.compile "
            "yet with ring_impl='allgather': use ring_impl='p2p', call usp attention with a "
            "window on packed input eagerly (outside the compiled region), or compile it "
            "on dense input"
        )
    u, r = plan.ulysses_degree, plan.ring_degree
    local_len = spec.seqlen_q
    if packed is not None:
        if spec.batch != 1:
            raise ShardingError(
                f"packed sequences (cu_seqlens) need batch size 1, got {spec.batch}"
            )
        _check_segments(plan, bool(packed.placement.segments))
        if packed.placement.device != q.device:
            raise ShardingError(
                f"the PackedSequence was built for {packed.placement.device}, q is on "
                f"{q.device}; pass device= to Plan.pack"
            )
    else:
        try:
            check_sequence_length(local_len * u * r, r, u, plan.layout)
        except ShardingError as err:
            raise ShardingError(
                f"{err} (each of the {u * r} SP ranks holds {local_len} tokens)"
            ) from None
    replication = 1
    if u > 1:
        replication = kv_replication_for(
            spec.num_heads, spec.num_kv_heads, u, plan.sp_degree,
            plan.topology.rank_map.ranks_per_node,
        )  # fmt: skip
    # what the ring sees after the all-to-all: the ring rank's block, H/u heads
    ring_spec = dataclasses.replace(
        spec, seqlen_q=local_len * u, seqlen_k=local_len * u, num_heads=spec.num_heads // u,
        num_kv_heads=spec.num_kv_heads * replication // u,
    )  # fmt: skip
    ring_group = plan.ring_group
    placement = (
        packed.placement
        if packed is not None
        else ring_placement(ring_spec, ring_group, plan.layout, plan.ring_impl, None)
    )
    longest = max(placement.documents.lengths)
    ring = prepare_ring(
        ring_spec, ring_group, placement, causal=causal, softmax_scale=softmax_scale,
        layout=plan.layout, ring_impl=plan.ring_impl, backend=plan.backend,
        comm_stats=plan.comm_stats, kv_head_chunks=head_chunks,
        window=kernel_window(window, longest), kernel_registry=plan.kernel_registry,
        kv_dims=mla_dims(q, k, v),  # MLA: ring messages at K's and V's own head sizes
    )  # fmt: skip
    ulysses = TracedGroup.of(plan.ulysses_group) if u > 1 else None
    per_rank = spec.num_heads // u
    first = 0 if ulysses is None else ulysses.rank * per_rank  # all-to-all: chunk j to rank j
    return CheckedCall(replication, ring, ulysses, (first, first + per_rank))


def attend(
    plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    packed=None,
    verify: bool | None = None,
    head_chunks: int = 1,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    partial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:meth:`usp.Plan.attention` (see :func:`usp.usp_attention` for the arguments);
    ``plan`` is a :class:`usp.Plan`. ``head_chunks``: the ring attends to that many
    groups of its (post-all-to-all) KV heads one after the other
    (``ring_attention``'s ``kv_head_chunks``), bounding its buffers to one group.
    ``partial``: (out [B, S/P, H, Dv], lse [B, S/P, H]) of more keys per row, computed
    by the caller (eagerly), merged in (:mod:`usp.ring.partial`).

    Under ``torch.compile`` the call is checked (and, with ``verify``, agreed across the
    SP ranks) while the graph is traced, once per plan and call shape
    (:func:`traced_call`): the graph holds only the collectives and the computation."""
    dims = mla_dims(q, k, v)  # MLA: K's and V's own head sizes, None when equal
    if dims is not None and dims.value_dim > dims.key_dim and softmax_scale is None:
        softmax_scale = dims.key_dim**-0.5  # q/k are padded to v's size below
    live = None  # the placement a compiled graph reads documents from (cfg's eagerly)
    if torch.compiler.is_compiling():
        if partial is not None:
            raise AttentionInputError("partial results are not supported under torch.compile")
        call = _traced(
            plan, q, k, v, causal, softmax_scale, packed, verify, head_chunks, sinks, window
        )
        ulysses = call.ulysses
        live = live_placement(packed)
    else:
        grad = grad_mask(q, k, v, sinks)
        call = checked(
            plan, q, k, v, causal, softmax_scale, packed, verify, head_chunks, grad, sinks,
            window, partial=partial,
        )  # fmt: skip
        ulysses = plan.ulysses_group
    stats = plan.comm_stats
    if partial is not None:
        partial = (partial[0], partial[1].unsqueeze(-1))  # lse [B, S/P, H, 1]: a head dim
    if plan.ulysses_degree > 1:
        k, v = replicate_kv_heads(k, v, call.kv_replication)
        # each tensor at its own head size (MLA: v's smaller or larger than q/k's)
        q, k, v, *partial = to_head_sharded([q, k, v, *(partial or ())], ulysses, stats)
        partial = tuple(partial) or None  # [B, S/r, h/u, Dv], [B, S/r, h/u, 1]
    if partial is not None:
        partial = (partial[0], partial[1].squeeze(-1).transpose(1, 2))  # lse [B, h, S/r]
    local_sinks = None if sinks is None else sinks[call.heads[0] : call.heads[1]]  # [H/u]
    if dims is not None:
        # the kernels take one head size: pad after the all-to-all, where nothing
        # travels but the ring's messages, which carry K and V at their own sizes
        # (call.ring.kv_dims, usp.ring.kv_message)
        q, k, v = pad_head_dims(q, k, v, dims)
    out, _ = run_ring(q, k, v, call.ring, live, local_sinks, partial)
    if dims is not None:
        out = out[..., : dims.value_dim]  # [B, S/r, H/u, Dv]: the padded columns are zeros
    if plan.ulysses_degree > 1:
        out = to_sequence_sharded(out, ulysses, stats)  # [B, S/P, H, Dv]
    return out


def mla_dims(q, k, v) -> KVDims | None:
    """A value head size other than the query/key one (MLA: DeepSeek-V3's q/k 192, v
    128): K's and V's head sizes, or None when they are equal or the shapes do not fit
    otherwise (left to the checks). The kernels take one head size, so the smaller of
    the two is zero-padded to the larger after the all-to-all (:func:`pad_head_dims`),
    which changes nothing: zero columns of v give zero output columns (sliced off
    after), zero columns of q and k add nothing to the scores (the default scale stays
    the query's own head_dim**-0.5)."""
    shapes_fit = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
    if not shapes_fit or k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1]:
        return None
    if v.shape[-1] == q.shape[-1]:
        return None
    return KVDims(q.shape[-1], v.shape[-1])


def pad_head_dims(q, k, v, dims: KVDims):
    """q, k [..., Dqk] and v [..., Dv] -> all three [..., max(Dqk, Dv)] (zero columns)."""
    if dims.value_dim < dims.key_dim:
        return q, k, F.pad(v, (0, dims.key_dim - dims.value_dim))
    extra = dims.value_dim - dims.key_dim
    return F.pad(q, (0, extra)), F.pad(k, (0, extra)), v


def _padded_stand_ins(q, k, v):
    """What the checks see of an MLA call: q, k and v as the kernels get them, padded to
    one head size (:func:`pad_head_dims`), as stand-ins holding one element (the checks
    read shapes only); the tensors themselves when their head sizes are equal."""
    dims = mla_dims(q, k, v)
    if dims is None:
        return q, k, v
    size = max(dims.key_dim, dims.value_dim)
    return tuple(_stand_in((tuple(t.shape[:-1]) + (size,), t.dtype, t.device)) for t in (q, k, v))


def checked(
    plan, q, k, v, causal, softmax_scale, packed, verify, head_chunks, grad: int, sinks=None,
    window=None, compiled=False, partial=None,
) -> CheckedCall:  # fmt: skip
    """The call validated on this rank and, with ``verify``, agreed across the SP ranks
    (the same error on every rank when any rank's call fails); ``grad``: whether the
    call needs gradients (:func:`usp.comm.call_check.grad_mask` of q, k, v, sinks: part
    of what the ranks agree on)."""
    packed_seq: PackedSequence | None = None

    def validate() -> CheckedCall:
        nonlocal packed_seq
        q_shape = getattr(q, "shape", ())
        total = q_shape[1] * plan.sp_degree if len(q_shape) > 1 else None
        packed_seq = plan.packed_sequence(packed, device=getattr(q, "device", None), seq_len=total)
        return check_call(
            plan, q, k, v, causal, softmax_scale, packed_seq, head_chunks, sinks, window,
            compiled, partial,
        )  # fmt: skip

    def fields():
        return attention_fields(
            plan, q, k, v, causal=causal, softmax_scale=softmax_scale, packed=packed_seq,
            head_chunks=head_chunks, grad=grad, sinks=sinks, window=window, compiled=compiled,
            partial=partial,
        )  # fmt: skip

    return checked_call(plan.sp_group, "usp_attention", fields, validate, USP_ERRORS, verify)


# ------------------------------------------------------------------ compiled graphs
def _tensor_signature(x):
    """What a check reads of a tensor, as constants of the graph being traced (shapes
    specialised: the ring's blocks depend on them); None for anything else."""
    if not isinstance(x, torch.Tensor):
        return None
    return tuple(operator.index(n) for n in x.shape), x.dtype, x.device


def _check_packed_type(packed) -> None:
    if not isinstance(packed, PackedSequence):
        raise PlanError(
            "under torch.compile, packed documents must be a usp.sp.plan.PackedSequence built outside "
            "the compiled call (plan.pack(cu_seqlens)): raw cu_seqlens would be read on the host "
            "inside the graph"
        )


def packed_signature(packed):
    """A PackedSequence as constants: its boundaries and what it was built for (so that a
    new PackedSequence of the same documents reuses the graph: no guard on its identity).
    ``operator.index`` makes Dynamo specialise each boundary (a recompile for new
    documents keeps them constants instead of making them symbolic)."""
    if packed is None:
        return None
    _check_packed_type(packed)
    placement = packed.placement
    return (
        tuple(operator.index(b) for b in packed.bounds), packed.ring_degree,
        packed.ulysses_degree, packed.layout, placement.device, bool(placement.segments),
    )  # fmt: skip


def _specialised(placement) -> bool:
    """Whether a compiled graph is specialised to the placement's documents: the
    all-gather ring's segments index by document (bool(): what Dynamo reads of a
    constant's dict)."""
    return bool(placement.segments)


def call_signature(packed):
    """What a compiled attention call is specialised to of its PackedSequence. The p2p
    ring and a ring of one read only the sequence's shape (its length, and whether it
    holds several documents: one document is a dense sequence): the boundaries reach
    the graph as tensors (:func:`live_placement`), so one graph serves every packing
    of that shape. The all-gather ring indexes the gathered K/V by document (index
    tensors whose sizes depend on the documents): its graph is specialised to the
    boundaries (:func:`packed_signature`), and new documents recompile."""
    if packed is None:
        return None
    _check_packed_type(packed)
    placement = packed.placement
    if _specialised(placement):
        return packed_signature(packed)
    return (
        "shape", operator.index(packed.seq_len), packed.ring_degree, packed.ulysses_degree,
        packed.layout, placement.device, placement.packed,
    )  # fmt: skip


def live_placement(packed):
    """In a compiled graph, the placement of the PackedSequence given to this call (its
    tensors are graph inputs), for :func:`usp.ring.api.run_ring`: None when it has no
    piece documents (dense, one document) or when the graph is specialised to them (the
    all-gather ring)."""
    if packed is None or _specialised(packed.placement) or not packed.placement.packed:
        return None
    return packed.placement


def _traced(
    plan, q, k, v, causal, softmax_scale, packed, verify, head_chunks, sinks=None, window=None
) -> CheckedCall:
    """Traced by Dynamo: the call's description as constants, then :func:`traced_call`.
    The plan goes as its class, topology and choices (a plan made inside the trace, as
    ``usp_attention(..., topology)`` makes one, is not an object outside it)."""
    choices = (plan.layout, plan.ring_impl, plan.backend, plan.verify_calls)
    return traced_call(
        type(plan), plan.topology, choices, _tensor_signature(q), _tensor_signature(k),
        _tensor_signature(v), causal, softmax_scale, call_signature(packed), verify,
        head_chunks, grad_mask(q, k, v, sinks), _tensor_signature(sinks), window,
    )  # fmt: skip


@constant_result
def traced_call(
    plan_type, topology, choices, q_sig, k_sig, v_sig, causal, softmax_scale, packed_sig,
    verify, head_chunks, grad, sinks_sig=None, window=None,
) -> CheckedCall:  # fmt: skip
    """The checked call of a compiled graph, run eagerly while Dynamo traces (its result
    is a constant of the graph): :func:`checked` on stand-ins of the tensors (their shape,
    dtype and device, no data), so the same checks and the same agreement run, once per
    plan and call shape (the ``traced_calls`` of ``plan_type.lasting(topology,
    *choices)``). A failed check fails the trace with the check's message, on every
    rank alike when ``verify``."""
    plan = plan_type.lasting(topology, *choices)
    key = (
        q_sig, k_sig, v_sig, causal, softmax_scale, packed_sig, verify, head_chunks, grad, sinks_sig,
        window,
    )  # fmt: skip
    cache = plan.traced_calls
    call = cache.get(key)
    if call is None:
        q, k, v, sinks = (_stand_in(s) for s in (q_sig, k_sig, v_sig, sinks_sig))
        packed = stand_in_packed(plan, packed_sig)
        call = checked(
            plan, q, k, v, causal, softmax_scale, packed, verify, head_chunks, grad, sinks,
            window, compiled=True,
        )  # fmt: skip
        cache.put(key, call)
    return call


def _stand_in(signature):
    """A tensor of the signature's shape, dtype and device holding one element (a
    zero-stride view): validation reads no data."""
    if signature is None:
        return None
    shape, dtype, device = signature
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def stand_in_packed(plan, signature) -> PackedSequence | None:
    """The PackedSequence a signature describes, built again by ``plan`` (refused as the
    original would be where it does not fit the plan). For a :func:`call_signature` of
    the shape only, a packing of that shape: one document, or two (the first one chunk
    of every ring rank long), which the checks and the kernels' choice see alike."""
    if signature is None:
        return None
    if signature[0] == "shape":
        _, seq_len, ring_degree, ulysses_degree, layout, device, several = signature
        bounds = (0, layout_chunks(layout, ring_degree), seq_len) if several else (0, seq_len)
        signature = (bounds, ring_degree, ulysses_degree, layout, device, False)
    bounds, ring_degree, ulysses_degree, layout, device, has_segments = signature
    check_packed_fits(
        (ring_degree, ulysses_degree, layout), (plan.ring_degree, plan.ulysses_degree, plan.layout)
    )
    _check_segments(plan, has_segments)
    cu = torch.tensor(bounds, dtype=torch.int32)
    return plan.pack(cu, device=device, seq_len=bounds[-1], agree_ranks=False)


class TraceCache:
    """What the traces of compiled graphs prepared (checked calls, packed inputs), by
    the constants that describe it, the most recent ``capacity``: each is checked, and
    its ranks agree, once (a retrace of the same call reuses it)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, object] = OrderedDict()

    def get(self, key: tuple, default=None):
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: tuple, value) -> None:
        self._entries[key] = value
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

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

This module sits below :mod:`usp.plan`: :func:`attend` reads the pieces it needs from
the plan it is given (degrees, groups, options, ``packed_sequence``) and imports no plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from usp.call_check import call_fields, checked_call, needs_grad
from usp.comm.agreement import Field
from usp.kernels.spec import validate_inputs
from usp.options import BACKENDS, LAYOUTS, RING_IMPLS
from usp.packing import PackedSequence, PlanError
from usp.process_groups import HeadLayoutError
from usp.ring.api import RING_ERRORS, prepare_ring, ring_placement, run_ring
from usp.ring.config import RingConfig
from usp.sharding import ShardingError, check_sequence_length
from usp.ulysses import (
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
    the ring's validated call (its kernels resolved once)."""

    kv_replication: int
    ring: RingConfig


def check_call(plan, q, k, v, causal, softmax_scale, packed, head_chunks=1) -> CheckedCall:
    """Everything that could fail, checked on this rank before anything is sent."""
    spec = validate_inputs(q, k, v, causal=causal, window=None)
    u, r = plan.ulysses_degree, plan.ring_degree
    local_len = spec.seqlen_q
    if packed is not None:
        if spec.batch != 1:
            raise ShardingError(
                f"packed sequences (cu_seqlens) need batch size 1, got {spec.batch}"
            )
        if plan.ring_impl == "allgather" and r > 1 and not packed.placement.segments:
            raise PlanError(
                "this PackedSequence was packed by a plan with ring_impl='p2p', so it holds no "
                "all-gather indices; pack it with the plan that attends (ring_impl='allgather')"
            )
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
    ring = prepare_ring(
        ring_spec, ring_group, placement, causal=causal, softmax_scale=softmax_scale,
        layout=plan.layout, ring_impl=plan.ring_impl, backend=plan.backend,
        comm_stats=plan.comm_stats, kv_head_chunks=head_chunks,
    )  # fmt: skip
    return CheckedCall(replication, ring)


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
) -> torch.Tensor:
    """:meth:`usp.Plan.attention` (see :func:`usp.usp_attention` for the arguments);
    ``plan`` is a :class:`usp.Plan`. ``head_chunks``: the ring attends to that many
    groups of its (post-all-to-all) KV heads one after the other
    (``ring_attention``'s ``kv_head_chunks``), bounding its buffers to one group."""
    packed_seq: PackedSequence | None = None

    def validate() -> CheckedCall:
        nonlocal packed_seq
        q_shape = getattr(q, "shape", ())
        total = q_shape[1] * plan.sp_degree if len(q_shape) > 1 else None
        packed_seq = plan.packed_sequence(packed, device=getattr(q, "device", None), seq_len=total)
        return check_call(plan, q, k, v, causal, softmax_scale, packed_seq, head_chunks)

    def fields():
        options = {
            "layout": (plan.layout, LAYOUTS),
            "ring_impl": (plan.ring_impl, RING_IMPLS),
            "backend": (plan.backend, BACKENDS),
        }
        documents = 0 if packed_seq is None else packed_seq.fingerprint
        chunks = head_chunks if type(head_chunks) is int else -1
        return call_fields(
            q, k, causal=causal, softmax_scale=softmax_scale, options=options,
            documents_hash=documents, needs_grad=needs_grad(q, k, v),
        ) + [Field("head_chunks", chunks)]  # fmt: skip

    call = checked_call(plan.sp_group, "usp_attention", fields, validate, USP_ERRORS, verify)
    topology, u = plan.topology, plan.ulysses_degree
    stats = plan.comm_stats
    if u > 1:
        k, v = replicate_kv_heads(k, v, call.kv_replication)
        q, k, v = to_head_sharded([q, k, v], topology.ulysses_group, stats)  # [B, S/r, h/u, D]
    out, _ = run_ring(q, k, v, call.ring)
    if u > 1:
        out = to_sequence_sharded(out, topology.ulysses_group, stats)  # [B, S/P, H, D]
    return out

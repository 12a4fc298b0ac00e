"""What a model reads from its plan: the ``plan`` argument of the constructors and
loaders, the head counts checked against the plan's Ulysses degree, and cu_seqlens (or a
PackedSequence) turned into one PackedSequence per forward (``usp.sp.plan.as_plan`` makes the plan)."""

from __future__ import annotations

import warnings

import torch

from usp.process_groups.degrees import kv_replication_for
from usp.sp.placed import placed_packing
from usp.sp.plan import PackedSequence, Plan

#: the keyword arguments a model takes besides its config and plan (``usp.Plan.with_options``)
ATTENTION_OPTIONS = ("layout", "ring_impl", "backend", "linear_backend", "linear_conv_backend")


def plan_argument(plan, options: dict, where: str):
    """``plan`` of a public model constructor or loader named ``where`` (e.g.
    ``"Llama.from_pretrained"``), taking ``topology=`` from ``options`` -- the keyword's
    name before the family seam renamed it ``plan`` -- with a DeprecationWarning naming
    the new one (the same value: a Topology, a Plan or None); both at once is a
    TypeError. ``options`` is changed in place."""
    if "topology" not in options:
        return plan
    topology = options.pop("topology")
    if plan is not None:
        raise TypeError(
            f"{where}() got plan= and topology=: give plan= only (topology= is its old name)"
        )
    warnings.warn(
        f"{where}(topology=...) is now {where}(plan=...): a usp.Plan, or a Topology as before",
        DeprecationWarning,
        stacklevel=3,
    )
    return topology


def check_attention_options(options: dict, where: str) -> None:
    """A TypeError naming ``where`` for a keyword a model does not take (instead of one
    from a function it forwards to)."""
    unknown = sorted(set(options) - set(ATTENTION_OPTIONS))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"it takes a config, plan= and the attention options {', '.join(ATTENTION_OPTIONS)}"
        )


def check_heads(plan: Plan, num_heads: int, num_kv_heads: int) -> None:
    """Fail at model construction (not at the first forward) when the Ulysses degree
    cannot split the heads; the error lists the (ulysses, ring) pairs that can."""
    if plan.topology.single_process:
        return
    kv_replication_for(
        num_heads, num_kv_heads, plan.ulysses_degree, plan.sp_degree,
        plan.topology.rank_map.ranks_per_node,
        subject=f"this model's {num_heads} query heads / {num_kv_heads} KV heads cannot be "
        f"split over ulysses={plan.ulysses_degree}",
    )  # fmt: skip


def ring_kv_heads(plan: Plan, num_heads: int, num_kv_heads: int) -> int:
    """The KV heads each rank's ring attends to: after KV replication, / ulysses."""
    if plan.topology.single_process:
        return num_kv_heads
    return kv_heads_per_ring(
        num_heads, num_kv_heads, plan.ulysses_degree, plan.sp_degree,
        plan.topology.rank_map.ranks_per_node,
    )  # fmt: skip


def kv_heads_per_ring(
    num_heads: int, num_kv_heads: int, ulysses: int, sp: int, ranks_per_node: int
) -> int:
    """:func:`ring_kv_heads` from the degrees alone (the planner's grids)."""
    if ulysses == 1:
        return num_kv_heads
    replication = kv_replication_for(num_heads, num_kv_heads, ulysses, sp, ranks_per_node)
    return num_kv_heads * replication // ulysses


def pack_once(plan: Plan, cu_seqlens, input_ids: torch.Tensor) -> PackedSequence | None:
    """The forward's packed sequence: validated and on ``input_ids``' device once, then
    handed to every layer (no host syncs inside the layers)."""
    if cu_seqlens is None:
        return None
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"packed sequences (cu_seqlens) need batch size 1, got input_ids of shape "
            f"{tuple(input_ids.shape)}"
        )
    local_len = input_ids.shape[1]
    if plan.placement == "documents":  # ranks hold different counts: agreed where verified
        return placed_packing(plan, cu_seqlens, local_len, input_ids.device)
    if isinstance(cu_seqlens, PackedSequence):
        return plan.shard_packing(cu_seqlens, local_len)
    # a collective (the SP ranks agree on the boundaries), once per forward
    return plan.pack(cu_seqlens, device=input_ids.device, seq_len=local_len * plan.sp_degree)

"""The functional API: each function is the matching :class:`usp.Plan` method.

``plan`` is a :class:`usp.Plan`, or a :class:`~usp.process_groups.Topology` (a plan
with the default choices is made for it), or None (one process).

``layout=`` picks the sequence layout where ``plan`` is a Topology (pass the same to
:func:`usp.usp_attention`; a Plan carries it for both instead). Given a Plan, ``layout``
may only repeat the plan's own: sharding in another layout than the plan attends in
would silently pair the wrong tokens, so that is a :class:`~usp.sp.plan.PlanError` saying
to build the Plan with that layout. (:func:`sequence_multiple` only answers a question
and takes any layout.)
"""

from __future__ import annotations

import torch

from usp.sp.plan import Plan, PlanError, as_plan


def _plan(plan, layout: str | None, what: str) -> Plan:
    if isinstance(plan, Plan) and layout is not None and layout != plan.layout:
        raise PlanError(
            f"{what}(..., layout={layout!r}) on a Plan whose layout is {plan.layout!r}: the "
            "tokens would be placed differently from how plan.attention reads them. Build "
            f"the plan with layout={layout!r} (usp.Plan(topology, layout={layout!r}) or "
            "plan.with_options(layout=...)) and leave out layout="
        )
    return as_plan(plan, layout=layout)


def sequence_multiple(plan, layout: str | None = None) -> int:
    """What the global length of a dense sequence must be a multiple of (in ``layout``,
    default the plan's)."""
    return as_plan(plan, layout=layout).sequence_multiple


def shard_sequence(
    x: torch.Tensor, plan, *, dim: int = 1, layout: str | None = None, cu_seqlens=None
) -> torch.Tensor:
    """This rank's shard of ``x`` (the full sequence, identical on every SP rank) along
    ``dim``, in the order ``usp_attention`` expects (pass the same ``cu_seqlens`` for a
    packed sequence). Differentiable (an index_select)."""
    return _plan(plan, layout, "shard_sequence").shard(x, dim=dim, packed=cu_seqlens)


def gather_sequence(
    x_local: torch.Tensor, plan, *, dim: int = 1, layout: str | None = None, cu_seqlens=None
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence, on every SP rank (a
    collective over the SP group; no gradient)."""
    return _plan(plan, layout, "gather_sequence").gather(x_local, dim=dim, packed=cu_seqlens)


def local_token_indices(
    seq_len: int, plan, *, layout: str | None = None, cu_seqlens=None, device=None
) -> torch.Tensor:
    """Indices into the global sequence of the tokens this rank holds (int64, local order)."""
    chosen = _plan(plan, layout, "local_token_indices")
    return chosen.token_indices(seq_len, packed=cu_seqlens, device=device)


def local_position_ids(
    cu_seqlens: torch.Tensor | None,
    plan,
    *,
    seq_len: int | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """RoPE position ids of this rank's tokens (int64 [S/P], local order): positions
    inside each document of a packed sequence, or with ``cu_seqlens=None`` the global
    positions of a dense sequence of ``seq_len`` tokens."""
    chosen = _plan(plan, layout, "local_position_ids")
    if cu_seqlens is None:
        if seq_len is None:
            raise PlanError("local_position_ids needs seq_len for a dense sequence")
        return chosen.position_ids(seq_len)
    total = cu_seqlens.seq_len if hasattr(cu_seqlens, "seq_len") else int(cu_seqlens[-1])
    return chosen.position_ids(total, packed=cu_seqlens)

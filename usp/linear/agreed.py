"""What every linear mixer's entry point does before its first collective: its checks on
this rank, then the SP ranks' agreement, so that a call that cannot run ends in the same
error on every rank and a call the ranks make differently is refused, before any data
moves (:mod:`usp.comm.agreement`).

:func:`checked_call` is that preamble; the rest are the checks and agreement fields the
entry points (:func:`usp.linear.gated_deltanet_usp`, :func:`usp.linear.mamba2_usp`,
:func:`usp.linear.kda_usp`, :func:`usp.linear.short_conv_usp`,
:func:`usp.linear.mamba1_usp`) share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from usp.comm import call_check
from usp.comm.agreement import Field, agree, can_agree, stable_hash
from usp.errors import InputError, ShardingError
from usp.linear.choice import GDN_HEADS
from usp.linear.conv import select_conv_kernel
from usp.linear.heads import document_bounds, documents_of, hashed
from usp.process_groups import HeadLayoutError, degrees
from usp.sp.ulysses import UlyssesHeadError

__all__ = [
    "ACTIVATIONS", "COMMON_ERRORS", "DTYPES", "checked_call", "choice_field", "delta_rule_call",
    "documents_field", "dtype_field", "eager_only", "grad_field", "ring_order_problem",
    "shape_field",
]  # fmt: skip

T = TypeVar("T")
#: the activations the mixers' convs take
ACTIVATIONS = (None, "silu")
#: the errors every entry point may raise besides its own (re-raised by class on every rank)
COMMON_ERRORS = (UlyssesHeadError, HeadLayoutError, ShardingError, InputError)
#: the activation dtypes a field names (anything else shows as "other")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def checked_call(
    plan,
    what: str,
    check: Callable[[], T],
    fields: Callable[[T | None], Sequence[Field]],
    errors: Sequence[type[BaseException]],
) -> T:
    """``check()`` on this rank, then (with more than one SP rank) the agreement of the
    SP ranks on ``fields(result)`` (``check()``'s result, None where it raised) and on any
    rank's error: returns ``check()``'s result, or raises on every rank the first failing
    rank's error (its class when it is one of ``errors``) or the ranks' disagreement.
    ``check`` raises an ``InputError`` or a ``HeadLayoutError`` for what it cannot
    compute; ``fields`` must not raise, whatever the inputs (every rank gives the same
    names)."""
    result, error = None, None
    try:
        result = check()
    except (InputError, HeadLayoutError) as err:
        error = err
    if plan is not None and plan.sp_degree > 1 and can_agree(plan.sp_group):
        agree(plan.sp_group, what, fields(result), error, errors)
    if error is not None:
        raise error
    return result


def eager_only(entry: str, layers: str, error: type[InputError], plan=None) -> None:
    """Refuse ``entry`` inside a compiled graph (its checks and ring block run eagerly),
    and under a ``plan`` that places documents by length (``placement="documents"``: the
    mixers beside Gated DeltaNet read the sequence's layout only). Both are the same on
    every rank (a plan option, the compile state), so no agreement is needed."""
    if torch.compiler.is_compiling():
        raise error(
            f"{entry} runs eagerly: compile the model around its {layers} layers "
            "(torch.compiler.disable on the layer), or run the model eagerly"
        )
    if getattr(plan, "placement", "sequence") == "documents":
        raise error(
            f"{entry} does not place documents by length yet: use a plan with "
            f'placement="sequence" (the default) for models with {layers} layers'
        )


def ring_order_problem(plan, what: str) -> str | None:
    """Why ``what`` cannot read the ring's gathered chunks in ring-rank order (the ring
    group orders its ranks differently from the plan's ring rank), or None."""
    if plan is None or plan.ring_degree == 1:
        return None
    rank = dist.get_rank(plan.ring_group)
    if rank == plan.ring_rank:
        return None
    return (
        f"the ring group orders its ranks differently from the ring rank ({rank} != "
        f"{plan.ring_rank}); {what} reads the gathered chunks in ring-rank order"
    )


def delta_rule_call(q, k, v, conv_weights, plan, packed, kernel, conv_kernel, *, select,
                    what: str, entry: str, error: type[InputError]):  # fmt: skip
    """The checks a delta-rule mixer's call (Gated DeltaNet, KDA) needs beyond its inputs'
    shapes: the key heads' repeat for the Ulysses split, the documents' placement, the
    recurrence's kernel (``select(name, device, dtype, dk, dv, kernels)`` with the ring's
    d_k extra value columns when a document spans chunks; ``kernel`` = (name, registry)),
    the conv's (``conv_kernel`` = (name, registry); with ``conv_weights``) and the ring's
    rank order. Returns (times, documents, kernel, conv kernel or None); raises
    ``UlyssesHeadError`` / ``ShardingError`` / the kernels' errors / ``error``."""
    u = 1 if plan is None else plan.ulysses_degree
    r = 1 if plan is None else plan.ring_degree
    heads, key_heads, dk, dv = v.shape[2], q.shape[2], q.shape[3], v.shape[3]
    times = degrees.kv_replication_for(
        heads, key_heads, u, u * r, error=UlyssesHeadError, names=GDN_HEADS,
        subject=f"cannot split {heads} {what} value heads / {key_heads} key heads over "
        f"ulysses={u}",
    )  # fmt: skip
    documents = documents_of(plan, v.shape[1] * u * r, packed)
    columns = dv + (dk if documents.chunks_per_doc > 1 else 0)  # the ring's [0 | I]
    impl = select(kernel[0], v.device, v.dtype, dk, columns, kernel[1])
    conv_impl = None
    if conv_weights is not None:  # this rank's channels: its heads after the all-to-all
        channels = (2 * key_heads * times * dk + heads * dv) // u
        conv_impl = select_conv_kernel(
            conv_kernel[0], v.device, v.dtype, channels, conv_weights[0].shape[1], conv_kernel[1]
        )
    problem = ring_order_problem(plan, entry)
    if problem is not None:
        raise error(problem)
    return times, documents, impl, conv_impl


def _dtype_index(x) -> int:
    dtype = getattr(x, "dtype", None)
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def dtype_field(name: str, tensors) -> Field:
    """The dtypes of ``tensors`` (None allowed), as one field."""
    codes = tuple(-1 if t is None else _dtype_index(t) for t in tensors)
    return Field(name, stable_hash(codes), lambda v: f"{hashed(v)} of {codes}")


def shape_field(name: str, values) -> Field:
    """Shapes and small options as one hashed field: ``values`` are tensors (their
    shapes; None and non-tensors count as -1) and ints."""
    flat: list[int] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            flat.extend([v.dim(), *v.shape])
        else:
            flat.append(int(v) if isinstance(v, int) else -1)
    return Field(name, stable_hash(flat), hashed)


def documents_field(documents) -> Field:
    """The documents (a :class:`usp.ring.documents.Documents`, or None where the check
    failed) as :func:`usp.comm.call_check.documents_field` shows them: their boundaries
    when the ranks disagree."""
    return call_check.documents_field(document_bounds(documents), "documents")


def choice_field(name: str, choice, names: Sequence[str]) -> Field:
    """A kernel's name among ``names`` (its index; -1 shows as "unknown")."""
    index = names.index(choice) if choice in names else -1
    return Field(name, index, lambda i: names[i] if 0 <= i < len(names) else "unknown")


def grad_field(names: Sequence[str], tensors) -> Field:
    """Which of ``tensors`` require grad (:func:`usp.comm.call_check.grad_mask`): ranks
    whose inputs differ here would run different backwards (one waits in a reduce-scatter
    its peer never enters)."""
    return call_check.grad_field(call_check.grad_mask(*tensors), names)

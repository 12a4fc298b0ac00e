"""The packed documents an HF model hands the USP attention plug-in, made exact or refused.

transformers gives a custom attention function its inputs in two places: the 2-D
**padding mask** (checked by :mod:`usp.models.hf_padding`, re-exported here) and the
**packed documents**: ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) keyword arguments
(``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), usp's own
``usp_packed`` keyword, or ``position_ids`` that restart per document (what sdpa
detects). :class:`PackedInputs` turns them into one :class:`usp.sp.plan.PackedSequence` per
forward (cached for the layers that follow), checks that the ``position_ids`` agree
with it, and under SP makes the SP ranks agree on the outcome before any attention
collective (one tiny all-gather per forward; inside a compiled graph, once per trace).

The contract under sequence parallelism: a rank's ``position_ids`` are its shard, so they
cannot tell documents apart. Pass the GLOBAL boundaries (``usp_packed=plan.pack(cu)`` or
global ``cu_seq_lens_q/k``) and this rank's positions (:func:`usp.models.shard_batch`,
:func:`usp.models.hf.shard_flattened`); position_ids that are not the ones those
boundaries give are refused on every rank.
"""

from __future__ import annotations

import torch

from usp.comm import traced
from usp.comm.agreement import Field, agree, can_agree
from usp.compile_marks import constant_result
from usp.models.hf_padding import (  # noqa: F401 - re-exported: the plug-in's inputs
    HFInputError,
    PaddingSeen,
    padding_mask_function,
    padding_problem,
    window_problem,
)
from usp.sp.attend import TraceCache, packed_signature, stand_in_packed
from usp.sp.plan import PackedSequence, PlanError
from usp.sp.sharding import ShardingError

#: the keyword of ``model(...)`` that carries a ``usp.sp.plan.PackedSequence`` to the attention
PACKED_KWARG = "usp_packed"
CU_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH_KWARGS = ("max_length_q", "max_length_k")


# ----------------------------------------------------------------------------- packing
class PackedInputs:
    """The packed documents of one forward, from the attention call's keyword arguments.

    Called by every layer; the first call of a forward does the work (host syncs, the SP
    agreement) and the layers after it get the cached result, recognised by the identity
    (and version) of the keyword tensors. Inside a compiled graph (:meth:`in_graph`) the
    documents are resolved while the graph is traced and ``position_ids`` are checked on
    the device, so the graph stays whole."""

    def __init__(self, plan, name: str):
        self.plan, self.name = plan, name
        self._key: tuple | None = None
        self._value: PackedSequence | None = None
        #: the documents the traces of compiled graphs resolved (see traced_documents)
        self.traced = TraceCache()

    def __call__(self, batch: int, local_len: int, device, kwargs: dict, problem=None):
        """``problem``: a refusal the caller found for this call (a message, raised as an
        HFInputError after the SP ranks agreed, so that every rank raises it)."""
        if torch.compiler.is_compiling():
            if problem is not None:  # a verdict of what the trace sees: the same on every rank
                raise HFInputError(problem)
            return self.in_graph(batch, local_len, device, kwargs)
        return self._resolve_eager(batch, local_len, device, kwargs, problem)

    def in_graph(self, batch: int, local_len: int, device, kwargs: dict):
        """The same verdicts inside a compiled graph. Documents (``usp_packed`` or
        ``cu_seq_lens_q/k``) are resolved, and the SP ranks agree on them, while the graph
        is traced (:func:`traced_documents`): the graph is specialised to them, and with
        ``cu_seq_lens`` (tensors whose values a guard cannot see) it checks on the device
        that they are still those; ``usp_packed`` with new documents recompiles instead.
        ``position_ids`` are checked on the device (a failure is raised by the graph, on
        every SP rank alike). In one process without documents, position_ids that restart
        fail the check (they would be packed documents, which need a description)."""
        plan, name = self.plan, self.name
        refuse_cache(plan, kwargs, local_len, name)  # a Python bool: decided while tracing
        usp_packed = kwargs.get(PACKED_KWARG)
        cu = [kwargs.get(k) for k in CU_KWARGS]
        positions = _positions_2d(kwargs.get("position_ids"), batch, local_len, name)
        group = plan.traced_sp_group
        packed = source = None
        if usp_packed is None and cu[0] is None and cu[1] is None:
            if plan.sp_degree == 1:
                if positions is not None and positions.shape[-1] > 1:
                    traced.require(
                        (torch.diff(positions, dim=-1) == 1).all(),
                        f"attn_implementation={name!r}: position_ids restart (packed documents) "
                        "inside torch.compile; pass usp_packed=plan.pack(cu) or cu_seq_lens_q/k",
                    )
                return None
        else:
            maxima = [kwargs.get(k) for k in MAX_LENGTH_KWARGS]
            packed, reference = traced_documents(
                self, batch, local_len, device, *cu, *maxima, packed_signature(usp_packed)
            )
            source = PACKED_KWARG if usp_packed is not None else "cu_seq_lens_q/k"
            for key, given in zip(CU_KWARGS, cu):
                if given is not None:
                    expected = torch.tensor(packed.bounds, device=given.device)
                    traced.require(
                        (given.to(torch.int64) == expected).all(),
                        f"attn_implementation={name!r}: {key} are not the document boundaries "
                        "this compiled graph was traced with (a graph is specialised to its "
                        "documents, and a guard cannot see a tensor's values): under "
                        "torch.compile give new documents as usp_packed=plan.pack(cu), whose "
                        "graphs recompile for a new packing",
                        group,
                    )
        if positions is not None and (plan.sp_degree > 1 or packed is not None):
            if packed is None:  # a dense sequence under SP
                reference = _position_reference(plan, local_len * plan.sp_degree, None)
            ok = _positions_ok(positions, reference)
            traced.require(ok, _positions_message(plan, packed, source, name), group)
        return packed

    def _resolve_eager(self, batch: int, local_len: int, device, kwargs: dict, problem=None):
        sources = (kwargs.get(PACKED_KWARG), *(kwargs.get(k) for k in CU_KWARGS))
        positions = kwargs.get("position_ids")
        use_cache = bool(kwargs.get("use_cache"))
        key = ((batch, local_len, device, use_cache, problem), *sources, positions)
        versions = tuple(getattr(x, "_version", None) for x in (*sources, positions))
        cached = self._key
        if (
            cached is not None
            and cached[0] == key[0]
            and all(a is b for a, b in zip(cached[1], key[1:]))
            and cached[2] == versions
        ):
            return self._value
        self._key = None

        def local():
            if problem is not None:
                raise HFInputError(problem)
            return self._local(batch, local_len, device, kwargs)

        value = self.agreed(local)
        self._key, self._value = (key[0], key[1:], versions), value
        return value

    def agreed(self, local) -> PackedSequence | None:
        """``local()``'s PackedSequence (this rank's verdict), after the SP ranks agreed on
        it: an error on any rank is raised on every rank."""
        plan = self.plan
        error, packed = None, None
        try:
            packed = local()
        except (HFInputError, ShardingError, PlanError) as err:
            error = err
        group = plan.sp_group
        if group is not None and plan.sp_degree > 1 and can_agree(group):
            fingerprint = 0 if packed is None else packed.fingerprint
            agree(
                group, f"attn_implementation={self.name!r} inputs",
                [Field("packed documents", fingerprint, _show_documents)], error,
                (HFInputError, ShardingError, PlanError),
            )  # fmt: skip
        if error is not None:
            raise error
        return packed

    def _local(self, batch, local_len, device, kwargs) -> PackedSequence | None:
        """This rank's verdict, without collectives."""
        plan, name = self.plan, self.name
        total = local_len * plan.sp_degree
        refuse_cache(plan, kwargs, local_len, name)
        usp_packed = kwargs.get(PACKED_KWARG)
        cu_q, cu_k = (kwargs.get(k) for k in CU_KWARGS)
        positions = _positions_2d(kwargs.get("position_ids"), batch, local_len, name)
        source = None
        if cu_q is not None or cu_k is not None:
            if usp_packed is not None:
                raise HFInputError(
                    f"attn_implementation={name!r} got both usp_packed and cu_seq_lens_q/k: "
                    "give one description of the packed documents"
                )
            cu = _self_attention_boundaries(cu_q, cu_k, name)
            packed = plan.pack(cu, device=device, seq_len=total, agree_ranks=False)
            _check_max_lengths(packed, kwargs, name)
            source = "cu_seq_lens_q/k"
        elif usp_packed is not None:
            packed = plan.packed_sequence(usp_packed, device=device, seq_len=total)
            source = PACKED_KWARG
        elif plan.sp_degree == 1 and positions is not None:
            packed = _packed_from_positions(plan, positions, device, name)
            source = None if packed is None else "position_ids that restart"
        else:
            packed = None
        if packed is not None and batch != 1:
            raise HFInputError(
                f"attn_implementation={name!r}: packed documents ({source}) need batch size 1, "
                f"got {batch}; flatten the rows into one (DataCollatorWithFlattening)"
            )
        if positions is not None and (plan.sp_degree > 1 or source in CU_SOURCES):
            _check_positions(plan, positions, total, packed, source, name)
        return packed


@constant_result
def traced_documents(
    inputs: PackedInputs, batch, local_len, device, cu_q, cu_k, max_q, max_k, packed_sig
) -> tuple[PackedSequence | None, tuple]:
    """The documents of a compiled graph's forward, resolved eagerly while the graph is
    traced (the result is a constant of the graph): :meth:`PackedInputs._local` on the
    ``cu_seq_lens``' values (read now) or on the ``usp_packed`` that ``packed_sig``
    describes, agreed across the SP ranks, once per description (``inputs.traced``).
    ``position_ids`` are left to the graph's own check, against the returned reference
    (:func:`_position_reference`)."""
    key = (batch, local_len, device, _values(cu_q), _values(cu_k), _values(max_q),
           _values(max_k), packed_sig)  # fmt: skip
    missing = object()
    packed = inputs.traced.get(key, missing)
    if packed is missing:

        def local():
            kwargs = dict(zip(CU_KWARGS, (cu_q, cu_k)))
            kwargs.update(zip(MAX_LENGTH_KWARGS, (max_q, max_k)))
            if packed_sig is not None:
                kwargs[PACKED_KWARG] = stand_in_packed(inputs.plan, packed_sig)
            return inputs._local(batch, local_len, device, kwargs)

        found = inputs.agreed(local)
        packed = (found, _position_reference(inputs.plan, local_len * inputs.plan.sp_degree, found))
        inputs.traced.put(key, packed)
    return packed


def refuse_cache(plan, kwargs: dict, local_len: int, name: str) -> None:
    """Under SP a KV cache (``use_cache=True``, transformers' default) would hold this
    rank's shard of the keys and values only: refused (in one process a cache is exact)."""
    if plan.sp_degree > 1 and kwargs.get("use_cache"):
        raise HFInputError(
            f"attn_implementation={name!r}: use_cache=True under sequence parallelism "
            f"({plan.sp_degree} SP ranks): the KV cache would hold this rank's {local_len} "
            f"of {local_len * plan.sp_degree} tokens only. Call the model with "
            "use_cache=False (ShardedBatch.hf_kwargs() gives it), or set "
            "model.config.use_cache = False"
        )


def _values(x):
    """A keyword's value as a hashable constant (a tensor's values as a tuple)."""
    return tuple(x.reshape(-1).tolist()) if isinstance(x, torch.Tensor) else x


CU_SOURCES = ("cu_seq_lens_q/k", PACKED_KWARG)


def _show_documents(value: int) -> str:
    return "dense" if value == 0 else f"documents with hash {value}"


def _positions_2d(positions, batch: int, local_len: int, name: str):
    """position_ids as [B or 1, S/P] (None stays None)."""
    if positions is None:
        return None
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if (
        positions.dim() != 2
        or positions.shape[-1] != local_len
        or positions.shape[0]
        not in (
            1,
            batch,
        )
    ):
        raise HFInputError(
            f"attn_implementation={name!r}: position_ids of shape {tuple(positions.shape)} do "
            f"not fit {batch} row(s) of {local_len} tokens (expected [B, S] or [1, S])"
        )
    return positions


def _self_attention_boundaries(cu_q, cu_k, name: str) -> torch.Tensor:
    if cu_q is None or cu_k is None:
        raise HFInputError(
            f"attn_implementation={name!r} got only one of cu_seq_lens_q / cu_seq_lens_k; "
            "give both (equal: self-attention over one packed sequence)"
        )
    for key, cu in zip(CU_KWARGS, (cu_q, cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point():
            raise HFInputError(
                f"attn_implementation={name!r}: {key} must be a 1-D integer tensor of "
                f"document boundaries [0, ..., total], got {cu!r}"
            )
    cu_q, cu_k = cu_q.to("cpu", torch.int32), cu_k.to("cpu", torch.int32)
    if not torch.equal(cu_q, cu_k):
        raise HFInputError(
            f"attn_implementation={name!r}: cu_seq_lens_q {cu_q.tolist()} differ from "
            f"cu_seq_lens_k {cu_k.tolist()}; USP attention is self-attention over one packed "
            "sequence (no KV cache, no cross-attention): the boundaries must be equal"
        )
    return cu_q


def _check_max_lengths(packed: PackedSequence, kwargs: dict, name: str) -> None:
    bounds = packed.bounds
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    for key in MAX_LENGTH_KWARGS:
        value = kwargs.get(key)
        if value is not None and int(value) < longest:
            raise HFInputError(
                f"attn_implementation={name!r}: {key}={int(value)} is shorter than the longest "
                f"document ({longest} tokens) of cu_seq_lens; give the longest length (or omit it)"
            )


def _packed_from_positions(plan, positions, device, name: str) -> PackedSequence | None:
    """One process: documents start where position_ids do not step by 1 (sdpa's rule)."""
    starts = torch.diff(positions, dim=-1) != 1  # [B, S-1]
    if not bool(starts.any()):
        return None
    if positions.shape[0] != 1:
        raise HFInputError(
            f"attn_implementation={name!r}: position_ids restart inside the rows of a batch of "
            f"{positions.shape[0]} (packed documents, or positions computed from a padding "
            "mask); USP packs documents in batch 1: flatten the rows into one "
            "(DataCollatorWithFlattening) or give position_ids that count 0, 1, 2, ... per row"
        )
    total = positions.shape[-1]
    inner = (starts[0].nonzero().flatten() + 1).to("cpu", torch.int32)
    cu = torch.cat(
        [torch.zeros(1, dtype=torch.int32), inner, torch.tensor([total], dtype=torch.int32)]
    )
    return plan.pack(cu, device=device, agree_ranks=False)


def _check_positions(plan, positions, total, packed, source, name: str) -> None:
    """position_ids must be the positions the documents give (this rank's shard under SP;
    in one process, any that count up by one inside every document)."""
    if not bool(_positions_ok(positions, _position_reference(plan, total, packed))):
        raise HFInputError(_positions_message(plan, packed, source, name))


def _position_reference(plan, total: int, packed) -> tuple[str, torch.Tensor]:
    """What position_ids [B, S/P] are checked against: in one process with documents,
    ``("steps", inside)``: they step by one wherever ``inside`` [S-1] is True; else
    ``("equal", expected)``: they are ``expected`` [S/P]."""
    if plan.sp_degree == 1 and packed is not None:
        inside = torch.ones(total - 1, dtype=torch.bool)
        inside[[b - 1 for b in packed.bounds[1:-1]]] = False
        return "steps", inside
    return "equal", plan.position_ids(total, packed=packed)


def _positions_ok(positions: torch.Tensor, reference: tuple[str, torch.Tensor]) -> torch.Tensor:
    """A bool tensor: the positions fit the reference (no data-dependent shape, so the
    same check runs inside a compiled graph)."""
    kind, values = reference
    values = values.to(positions.device)
    if kind == "steps":
        return torch.where(values, torch.diff(positions, dim=-1), 1).eq(1).all()
    return (positions == values).all()


def _positions_message(plan, packed, source, name: str) -> str:
    if plan.sp_degree == 1 and packed is not None:
        return (
            f"attn_implementation={name!r}: position_ids do not count up by one inside the "
            f"documents of {source}; give each document's positions 0, 1, 2, ... (the "
            "collator's position_ids) or leave position_ids out"
        )
    what = "dense sequence" if packed is None else f"documents of {source}"
    sp_rank = plan.ring_rank * plan.ulysses_degree + plan.ulysses_rank
    return (
        f"attn_implementation={name!r}: the position_ids of SP rank {sp_rank} are not the "
        f"positions of its tokens in the {what}. Under sequence parallelism a rank's "
        "position_ids are its shard and cannot tell documents apart: give packed documents "
        "as GLOBAL boundaries (usp_packed=plan.pack(cu), or cu_seq_lens_q/k of the whole "
        "sequence) and the positions from usp.models.shard_batch or "
        "usp.models.hf.shard_flattened"
    )

"""What an HF model hands the USP attention plug-in, made exact or refused.

transformers gives a custom attention function its inputs in two places:

* the **padding mask**: a 2-D ``attention_mask`` reaches the model's mask builder, never
  the attention function. :func:`padding_mask_function` is registered with the attention
  name in transformers' ``AttentionMaskInterface``: it sees the 2-D mask once per forward,
  refuses padding it cannot compute exactly (anything but zeros at the end of each row
  of a causal model in one process) and returns None, so no mask reaches the layers (the
  model never reads the jumps of zigzag ``position_ids`` as documents).
* the **packed documents**: ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) keyword arguments
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), usp's own
  ``usp_packed`` keyword, or ``position_ids`` that restart per document (what sdpa
  detects). :class:`PackedInputs` turns them into one :class:`usp.PackedSequence` per
  forward (cached for the layers that follow), checks that the ``position_ids`` agree
  with it, and under SP makes the SP ranks agree on the outcome before any attention
  collective (one tiny all-gather per forward).

The contract under sequence parallelism: a rank's ``position_ids`` are its shard, so they
cannot tell documents apart. Pass the GLOBAL boundaries (``usp_packed=plan.pack(cu)`` or
global ``cu_seq_lens_q/k``) and this rank's positions (:func:`usp.models.shard_batch`,
:func:`usp.models.hf.shard_flattened`); position_ids that are not the ones those
boundaries give are refused on every rank.
"""

from __future__ import annotations

import torch

from usp.comm.agreement import Field, agree
from usp.errors import InputError
from usp.plan import PackedSequence, PlanError, _can_agree
from usp.sharding import ShardingError

#: the keyword of ``model(...)`` that carries a ``usp.PackedSequence`` to the attention
PACKED_KWARG = "usp_packed"
CU_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH_KWARGS = ("max_length_q", "max_length_k")
_FIX_PADDING = (
    "pad at the end of each row and give the pads the ignore label -100 (or no mask at "
    "all), or pack the rows into one sequence: HF padding-free "
    "(DataCollatorWithFlattening / TRL padding_free=True) or usp_packed=plan.pack(cu)"
)


class HFInputError(InputError):
    """An input of an HF model with USP attention that the plug-in cannot compute exactly."""


# ----------------------------------------------------------------------------- padding
def padding_problem(plan, attention_mask: torch.Tensor, *, causal: bool) -> str | None:
    """Why the 2-D padding mask [B, S] (True: a real token) cannot be served, or None.

    Exact without a mask: no zeros; or, for a causal model in one process, zeros only
    at the end of each row (no real token attends to a later one). One host sync."""
    if attention_mask.dim() != 2:
        return f"attention_mask of shape {tuple(attention_mask.shape)} (expected [B, S])"
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None
    if plan.sp_degree > 1:
        return (
            "an attention_mask with zeros under sequence parallelism (each rank holds a shard "
            "of the sequence, so padding cannot be placed); pass no mask: "
            + _FIX_PADDING.replace("each row", "the global sequence")
        )
    if not causal:
        return (
            "an attention_mask with zeros in a bidirectional model (is_causal=False): every "
            "real token would attend to the pads; give rows without padding, or pack the rows "
            "into one sequence: HF padding-free (DataCollatorWithFlattening) or "
            "usp_packed=plan.pack(cu)"
        )
    # a real token after a pad: left padding (or holes), which needs a real mask
    later_token = mask[:, 1:] & ~mask[:, :-1]  # [B, S-1]
    if bool(later_token.any()):
        row = int(later_token.any(dim=1).nonzero()[0])
        return (
            f"an attention_mask with padding before real tokens (row {row}: left padding or "
            f"holes); USP attention applies no padding mask, so {_FIX_PADDING}. For "
            "generation, run the rows one at a time or use attn_implementation='sdpa'"
        )
    return None


def window_problem(plan, local_size, kv_length, kv_offset) -> str | None:
    """Why a mask of attention limited to ``local_size`` tokens cannot be served, or None.

    transformers' sliding-window and chunked masks (``create_sliding_window_causal_mask``,
    ``create_chunked_causal_mask``, the bidirectional sliding window) give the mask
    function ``local_size``; USP attention has no window, so it is exact only when the
    window holds the whole (global) sequence."""
    if local_size is None:
        return None
    total = (kv_offset + kv_length) * plan.sp_degree
    if local_size >= total:
        return None
    return (
        f"a mask of attention limited to {local_size} tokens (a sliding-window or chunked "
        f"attention layer: config.sliding_window / attention_chunk_size) for a sequence of "
        f"{total} tokens; USP attention computes full causal or bidirectional attention "
        f"only: give sequences of at most {local_size} tokens or use attn_implementation='sdpa'"
    )


class PaddingSeen:
    """Whether the current forward's 2-D mask had (right) padding, set by the mask
    function before the layers run; the attention function refuses it for a layer
    that turns out to be bidirectional (``module.is_causal=False``)."""

    def __init__(self):
        self.padded = False


def padding_mask_function(plan, name: str, seen: PaddingSeen):
    """The mask function registered with attention ``name``: checks the 2-D padding mask
    (once per forward) and returns None, so the layers get no mask. Under SP the ranks
    agree on the verdict, so a refusal is raised on every rank. A mask built with
    transformers' bidirectional mask function counts as non-causal whatever the config.
    A sliding-window or chunked mask whose window is shorter than the sequence is refused
    (:func:`window_problem`)."""
    from transformers.masking_utils import bidirectional_mask_function

    def usp_padding_mask(*args, attention_mask=None, config=None, mask_function=None, **kwargs):
        problem = None
        seen.padded = False
        window = window_problem(
            plan, kwargs.get("local_size"), kwargs.get("kv_length", 0), kwargs.get("kv_offset", 0)
        )  # the same on every rank (shapes and config): no agreement needed
        if window is not None:
            raise HFInputError(_padding_message(name, window))
        if attention_mask is not None:
            causal = bool(getattr(config, "is_causal", True))
            causal = causal and mask_function is not bidirectional_mask_function
            problem = padding_problem(plan, attention_mask, causal=causal)
            seen.padded = problem is None and not bool(attention_mask.bool().all())
        group = plan.sp_group  # None in one process (sp_degree 1)
        if attention_mask is not None and plan.sp_degree > 1 and _can_agree(group):
            error = None if problem is None else HFInputError(_padding_message(name, problem))
            agree(group, f"attn_implementation={name!r}", [], error, (HFInputError,))
        if problem is not None:
            raise HFInputError(_padding_message(name, problem))
        return None

    usp_padding_mask.usp_mask_for = name  # marks it as usp's (register may replace it)
    return usp_padding_mask


def _padding_message(name: str, problem: str) -> str:
    return f"attn_implementation={name!r} (USP attention) got {problem}"


# ----------------------------------------------------------------------------- packing
class PackedInputs:
    """The packed documents of one forward, from the attention call's keyword arguments.

    Called by every layer; the first call of a forward does the work (host syncs, the SP
    agreement) and the layers after it get the cached result, recognised by the identity
    (and version) of the keyword tensors. Under ``torch.compile`` at ``Plan(None)`` with
    neither ``cu_seq_lens`` nor ``usp_packed`` the positions are checked on the device
    instead (an assertion that fails if they restart), so the graph stays whole."""

    def __init__(self, plan, name: str):
        self.plan, self.name = plan, name
        self._key: tuple | None = None
        self._value: PackedSequence | None = None
        self._resolve = torch.compiler.disable(self._resolve_eager)

    def __call__(self, batch: int, local_len: int, device, kwargs: dict):
        described = kwargs.get(PACKED_KWARG) is not None or any(
            kwargs.get(k) is not None for k in CU_KWARGS
        )
        if torch.compiler.is_compiling() and self.plan.sp_degree == 1 and not described:
            positions = kwargs.get("position_ids")
            if positions is not None and positions.shape[-1] > 1:
                steps = torch.diff(positions, dim=-1)
                torch._assert_async(
                    (steps == 1).all(),
                    f"attn_implementation={self.name!r}: position_ids restart (packed documents) "
                    "inside torch.compile; pass usp_packed=plan.pack(cu) or cu_seq_lens_q/k",
                )
            return None
        return self._resolve(batch, local_len, device, kwargs)

    def _resolve_eager(self, batch: int, local_len: int, device, kwargs: dict):
        sources = (kwargs.get(PACKED_KWARG), *(kwargs.get(k) for k in CU_KWARGS))
        positions = kwargs.get("position_ids")
        key = (batch, local_len, device, *sources, positions)
        versions = tuple(getattr(x, "_version", None) for x in (*sources, positions))
        cached = self._key
        if (
            cached is not None
            and cached[0] == key[:3]
            and all(a is b for a, b in zip(cached[1], key[3:]))
            and cached[2] == versions
        ):
            return self._value
        self._key = None
        value = self._agreed(batch, local_len, device, kwargs)
        self._key, self._value = (key[:3], key[3:], versions), value
        return value

    def _agreed(self, batch, local_len, device, kwargs) -> PackedSequence | None:
        plan = self.plan
        error, packed = None, None
        try:
            packed = self._local(batch, local_len, device, kwargs)
        except (HFInputError, ShardingError, PlanError) as err:
            error = err
        group = plan.sp_group
        if group is not None and plan.sp_degree > 1 and _can_agree(group):
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
    if plan.sp_degree == 1 and packed is not None:
        steps = torch.diff(positions, dim=-1)  # [B, S-1]
        inside = torch.ones(total - 1, dtype=torch.bool)
        inside[[b - 1 for b in packed.bounds[1:-1]]] = False
        if bool((steps[:, inside.to(steps.device)] == 1).all()):
            return
        raise HFInputError(
            f"attn_implementation={name!r}: position_ids do not count up by one inside the "
            f"documents of {source}; give each document's positions 0, 1, 2, ... (the "
            "collator's position_ids) or leave position_ids out"
        )
    expected = plan.position_ids(total, packed=packed, device=positions.device)  # [S/P]
    if bool((positions == expected).all()):
        return
    what = "dense sequence" if packed is None else f"documents of {source}"
    sp_rank = plan.ring_rank * plan.ulysses_degree + plan.ulysses_rank
    raise HFInputError(
        f"attn_implementation={name!r}: the position_ids of SP rank {sp_rank} are not the "
        f"positions of its tokens in the {what}. Under sequence parallelism a rank's "
        "position_ids are its shard and cannot tell documents apart: give packed documents "
        "as GLOBAL boundaries (usp_packed=plan.pack(cu), or cu_seq_lens_q/k of the whole "
        "sequence) and the positions from usp.models.shard_batch or "
        "usp.models.hf.shard_flattened"
    )

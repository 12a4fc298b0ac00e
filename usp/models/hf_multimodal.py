"""Vision-language models under USP: :func:`shard_multimodal`.

    plan = usp.Plan(topology)
    name = usp.models.hf.register(plan)
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation=name)
    inputs = processor(text=..., images=..., return_tensors="pt")   # the global batch
    batch = usp.models.hf.shard_multimodal(plan, model, **inputs)   # this rank's part
    logits = model(**batch.hf_kwargs()).logits                      # [B, S/P, V]
    loss = usp.models.hf.sp_loss(logits, batch.labels, plan)

The model's forward then computes the multimodal forward exactly, as one process would
on the whole batch: the encoder's work is spread over the SP ranks by image (a video by
temporal patch), each rank encoding its share as the local encoder it is
(:mod:`usp.models.hf_multimodal_checks`); the features are all-gathered (their gradients
reduce-scattered back to the rank that encoded them), each rank keeps those of its own
placeholder tokens; positions are the model's own (Qwen's t/h/w rows from its
``get_rope_index`` over the global sequence, per document when packed) sharded like the
tokens; Gemma 3's image blocks are computed by USP attention
(:mod:`usp.models.hf_image_blocks`). Which families: :mod:`usp.models.hf_multimodal_models`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from usp.comm.agreement import Field, agree, can_agree
from usp.errors import InputError, ShardingError
from usp.linear.ring import ring_all_gather
from usp.models.batch import ShardedBatch, batch_fingerprint, shard_batch
from usp.models.hf_image_blocks import block_spans, every_rank_tokens, image_blocks
from usp.models.hf_multimodal_checks import IMAGE_BLOCKS_KWARG
from usp.models.hf_multimodal_models import PIXEL_KEYS, Unit, family_of
from usp.models.hf_padding import HFInputError
from usp.models.labels import IGNORE_INDEX
from usp.sp.plan import PackedSequence, as_plan

#: the keyword of ``model(...)`` that carries a batch's media (:class:`MediaInputs`)
MEDIA_KWARG = "usp_media"
_AGREED = (HFInputError, ShardingError, InputError)


@dataclass(frozen=True)
class MediaInputs:
    """What this rank's forward needs of a batch's media: its share of the encoder's work
    (``pixels``/``units`` per kind), every rank's feature rows (``rows``, group-rank
    order) and, per kind, where its own placeholder tokens' features are among the
    gathered rows (``local_index``)."""

    family: object
    pixels: dict
    units: dict
    rows: tuple[int, ...]
    local_index: dict
    group: object = None
    stats: object = None
    #: the encoder's plug-in checks (its own encoding runs locally), None: not usp's
    checks: object = None


@dataclass(frozen=True)
class MultimodalBatch(ShardedBatch):
    """A :class:`usp.models.ShardedBatch` with what a vision-language model's forward
    takes besides the tokens (``model_inputs``: the multimodal positions, the media,
    Gemma 3's image blocks)."""

    model_inputs: Mapping = field(default_factory=dict)

    def hf_kwargs(self) -> dict:
        return {**super().hf_kwargs(), **self.model_inputs}


def shard_multimodal(
    plan,
    model,
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    cu_seqlens=None,
    ignore_index: int = IGNORE_INDEX,
    attention_mask: torch.Tensor | None = None,
    **processor_outputs,
) -> MultimodalBatch:
    """This rank's part of a vision-language model's global batch: ``input_ids`` [B, S]
    and what the model's processor returned with them (``pixel_values``,
    ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
    ``mm_token_type_ids``, ``token_type_ids``). ``labels``, ``cu_seqlens`` (packed
    documents, B = 1; an image stays inside its document) and ``ignore_index`` as
    :func:`usp.models.shard_batch` takes them; an ``attention_mask`` must be all ones
    (padding: pack the rows instead). ``model(**batch.hf_kwargs())`` on every rank then
    computes the multimodal forward exactly (see the module docstring); the model's
    attention must be ``usp.models.hf.register(plan)``'s.

    Collective over the SP group (every rank calls it with the same batch: the ranks
    agree on the tokens and on the media's fingerprint; a bad input is one error on
    every rank, before anything else is exchanged). Any other processor output is
    refused, never dropped."""
    plan = as_plan(plan)
    error, family, units, fingerprint, checks, positions = None, None, [], 0, None, None
    try:
        family = family_of(model)
        checks = _registration(plan, model, family)
        _check_inputs(plan, family, input_ids, attention_mask, processor_outputs)
        units = family.units(processor_outputs)
        _check_tokens(family, input_ids, units)
        fingerprint = _media_fingerprint(processor_outputs)
        bounds = _bounds(cu_seqlens)
        positions = family.positions(model, input_ids, processor_outputs, bounds)  # [3, B, S]
    except (HFInputError, ShardingError, InputError) as err:
        error = err
    group = plan.sp_group
    if plan.sp_degree > 1 and can_agree(group):
        agree(group, "shard_multimodal", [Field("media", fingerprint, _show_hash)], error, _AGREED)
    if error is not None:
        raise error
    batch = shard_batch(plan, input_ids, labels=labels, cu_seqlens=cu_seqlens,
                        ignore_index=ignore_index)  # fmt: skip
    packed = batch.packed
    bounds = None if packed is None else list(packed.bounds)
    inputs: dict = {}
    if positions is not None:  # [3, B, S] -> [4, B, S/P]: the text row, then t/h/w
        local = plan.shard(positions, dim=2, packed=packed).to(batch.position_ids.device)
        inputs["position_ids"] = torch.cat([batch.position_ids[None], local])
    # (a batch without media too: its encoder's parameters get zero gradients, so that
    # every rank and replica reduces the same parameters)
    inputs[MEDIA_KWARG] = _media_inputs(plan, family, input_ids, packed, units,
                                        processor_outputs, checks)  # fmt: skip
    types_ = processor_outputs.get("token_type_ids")
    if family.type_key == "token_type_ids" and types_ is not None:
        blocks = _blocks(plan, types_, packed, bounds)
        if blocks is not None:
            inputs[IMAGE_BLOCKS_KWARG] = blocks
    add_media_forward(model)
    return MultimodalBatch(**_fields(batch), model_inputs=inputs)


def _bounds(cu_seqlens) -> list[int] | None:
    """The documents' global boundaries (a tensor or a PackedSequence's), None: dense."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, PackedSequence):
        return list(cu_seqlens.bounds)
    return [int(b) for b in cu_seqlens.tolist()]


def _fields(batch: ShardedBatch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(ShardedBatch)}


def _show_hash(value: int) -> str:
    return f"media with hash {value}"


# ----------------------------------------------------------------------------- checks
def _registration(plan, model, family):
    """The plug-in checks of the model's encoder attention (None: not usp's, e.g. sdpa),
    after checking that its text attention is ``usp.models.hf.register(plan)``'s."""
    from transformers import AttentionInterface

    functions = AttentionInterface._global_mapping
    text = model.config.get_text_config()._attn_implementation
    registered = getattr(functions.get(text), "usp_plan", None)
    grid = (plan.ulysses_degree, plan.ring_degree, plan.layout)
    if (
        registered is None
        or (registered.ulysses_degree, registered.ring_degree, registered.layout) != grid
    ):
        raise HFInputError(
            f"shard_multimodal: {type(model).__name__}'s attention is {text!r}, not USP "
            f"attention for this plan (ulysses {grid[0]} x ring {grid[1]}, {grid[2]}): "
            "register it first, name = usp.models.hf.register(plan), and build the model "
            "with attn_implementation=name"
        )
    encoder = family.encoders(model)[0].config._attn_implementation
    return getattr(functions.get(encoder), "usp_multimodal", None)


def _check_inputs(plan, family, input_ids, attention_mask, outputs: dict) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise HFInputError("input_ids must be the global batch [B, S] of token ids")
    unknown = sorted(k for k, v in outputs.items() if v is not None and k not in family.media_keys)
    if unknown:
        raise HFInputError(
            f"shard_multimodal got {', '.join(unknown)}, which it does not place for "
            f"{family.model_types[0]} (it takes {', '.join(family.media_keys)}); leave "
            "out what the model does not need, or train it in one process"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise HFInputError(
            "shard_multimodal got an attention_mask with padding: each rank holds a shard of "
            "the sequence, so pads cannot be placed; pack the rows into one sequence "
            "(cu_seqlens) instead"
        )
    for key in (family.type_key,):
        types_ = outputs.get(key)
        if types_ is not None and tuple(types_.shape) != tuple(input_ids.shape):
            raise HFInputError(
                f"{key} of shape {tuple(types_.shape)} do not match input_ids "
                f"{tuple(input_ids.shape)}"
            )


def _check_tokens(family, input_ids, units: list[Unit]) -> None:
    for kind, token in family.token_ids().items():
        have = int((input_ids == token).sum())
        need = sum(u.tokens for u in units if u.kind == kind)
        if have != need:
            raise HFInputError(
                f"the batch has {have} {kind} placeholder tokens (id {token}) but its "
                f"{PIXEL_KEYS[kind]} make {need} features: give the processor's outputs for "
                "exactly these input_ids"
            )


def _media_fingerprint(outputs: dict) -> int:
    """A hash of the media (pixels by their bits, grids, token types)."""
    tensors = []
    for key in sorted(outputs):
        value = outputs[key]
        if isinstance(value, torch.Tensor):
            flat = value.detach().contiguous().reshape(-1)
            tensors.append(flat.view(torch.uint8) if flat.is_floating_point() else flat)
    return batch_fingerprint(*tensors)


# ----------------------------------------------------------------------------- placement
def _assign(units: list[Unit], ranks: int) -> list[int]:
    """Each unit's group rank: the largest first, onto the least loaded (ties: the lower
    rank), the same on every rank."""
    load = [0] * ranks
    owner = [0] * len(units)
    for index in sorted(range(len(units)), key=lambda i: (-units[i].cost, i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += units[index].cost
    return owner


def _media_inputs(plan, family, input_ids, packed, units, outputs, checks) -> MediaInputs:
    ranks = plan.sp_degree
    me = dist.get_rank(plan.sp_group) if ranks > 1 else 0
    owner = _assign(units, ranks)
    rows = [0] * ranks
    gathered_at = []  # each unit's first row among the gathered [P * max rows]
    for unit, rank in zip(units, owner):
        gathered_at.append((rank, rows[rank]))
        rows[rank] += unit.tokens
    most = max(rows)
    first_row = [rank * most + offset for rank, offset in gathered_at]
    pixels, mine = {}, {}
    for kind in ("image", "video"):
        kind_units = [u for u, r in zip(units, owner) if u.kind == kind and r == me]
        if kind_units:
            source = outputs[PIXEL_KEYS[kind]]
            pixels[kind] = torch.cat([source[u.rows[0] : u.rows[1]] for u in kind_units])
            mine[kind] = kind_units
    tokens = plan.token_indices(input_ids.shape[1], packed=packed)  # [S/P]
    local_index = {}
    for kind, token in family.token_ids().items():
        kind_units = [(u, at) for u, at in zip(units, first_row) if u.kind == kind]
        if not kind_units:
            if kind == "image":  # no media: the (empty) features still reach the model
                local_index[kind] = torch.zeros(0, dtype=torch.long)
            continue
        feature_row = torch.cat([torch.arange(at, at + u.tokens) for u, at in kind_units])
        is_kind = (input_ids == token).to("cpu")  # [B, S]
        ordinal = is_kind.reshape(-1).cumsum(0).reshape(is_kind.shape) - 1
        local = is_kind[:, tokens.cpu()]  # [B, S/P]
        local_index[kind] = feature_row[ordinal[:, tokens.cpu()][local]]
    return MediaInputs(family, pixels, mine, tuple(rows), local_index,
                       plan.sp_group if ranks > 1 else None, plan.comm_stats, checks)  # fmt: skip


def _blocks(plan, token_types, packed, bounds):
    seq = token_types.shape[1]
    spans = [block_spans(row, bounds or [0, seq]) for row in token_types]
    if not any(spans):
        return None
    every = every_rank_tokens(plan, seq, packed).cpu()
    me = dist.get_rank(plan.sp_group) if plan.sp_degree > 1 else 0
    group = plan.sp_group if plan.sp_degree > 1 else None
    return image_blocks(spans, every, me, group)


# ----------------------------------------------------------------------------- forward
def expand_media(model, kwargs: dict) -> dict:
    """``kwargs`` of a forward with the media of :data:`MEDIA_KWARG` encoded: this rank's
    share through the model's encoder, every rank's features all-gathered, this rank's
    placeholder tokens' features as ``mm_encoder_outputs``. Collective over the SP group
    (every rank's forward calls it). Other kwargs are returned as they are."""
    media = kwargs.get(MEDIA_KWARG)
    if media is None:
        return kwargs
    kwargs = {k: v for k, v in kwargs.items() if k != MEDIA_KWARG}
    family = media.family
    parameter = next(model.parameters())
    encoding = contextlib.nullcontext() if media.checks is None else media.checks.own_encoding()
    with encoding:  # the encoder's attention: local (over each image's patches)
        pieces = [
            family.encode(model, kind, media.pixels[kind].to(parameter.device), media.units[kind])
            for kind in ("image", "video")
            if kind in media.units
        ]
    dim = family.feature_dim()
    if pieces:
        mine = torch.cat(pieces)  # [rows, dim]
    else:  # nothing to encode here: the encoder's parameters still get (zero) gradients,
        # as on every rank that encodes (FSDP2 reduces the same parameters on every rank)
        weights = [p for m in family.encoders(model) for p in m.parameters() if p.requires_grad]
        tie = sum(w.reshape(-1)[0] * 0 for w in weights) if weights else 0
        mine = parameter.new_zeros(0, dim) + tie
    most = max(media.rows)
    if media.group is not None and most:
        padded = torch.cat([mine, mine.new_zeros(most - mine.shape[0], dim)])
        every = ring_all_gather(padded, media.group, media.stats).reshape(-1, dim)
    else:
        every = mine
    outputs = dict(kwargs.get("mm_encoder_outputs") or {})
    for kind, index in media.local_index.items():
        outputs[kind] = family.encoder_output(every[index.to(every.device)])
    kwargs["mm_encoder_outputs"] = outputs
    return kwargs


def loss_body(model, kwargs: dict):
    """What the chunked loss's forward runs (:func:`usp.models.hf.add_loss_forward`), and
    its kwargs: with a batch's media (:func:`expand_media`), the base model, which places
    their features; otherwise the decoder (it takes the embeddings)."""
    kwargs = expand_media(model, kwargs)
    if "mm_encoder_outputs" in kwargs:
        return getattr(model, model.base_model_prefix), kwargs
    return model.get_decoder(), kwargs


def add_media_forward(model):
    """Give ``model``'s forward the keyword :data:`MEDIA_KWARG` (:func:`expand_media`
    before the model's own forward). In place, idempotent; returns the model."""
    if getattr(model, "usp_media_forward", False):
        return model
    inner = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return inner(*args, **expand_media(self, kwargs))

    model.forward = types.MethodType(forward, model)
    model.usp_media_forward = True
    return model

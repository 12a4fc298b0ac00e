"""HF transformers models under USP: an attention function for transformers'
``AttentionInterface`` and the loss an HF user needs.

    plan = usp.Plan(topology)
    model = AutoModelForCausalLM.from_pretrained(path)
    name = usp.models.hf.register(plan, model=model)  # checks it, switches its attention
    batch = usp.models.shard_batch(plan, input_ids)   # global -> this rank's shard
    logits = model(**batch.hf_kwargs()).logits        # [B, S/P, V]
    loss = usp.models.hf.sp_loss(logits, batch.labels, plan)
    # or, without materialising logits:
    loss = usp.models.hf.causal_lm_loss(model, batch, plan)

Every model that calls attention through ``AttentionInterface`` (Llama, Qwen2/3,
Mistral, Gemma 3 and gpt-oss with their sliding windows, gpt-oss's attention sinks
(``s_aux``), ...) runs this way, if nothing else in it mixes tokens: under SP any other
model (Mamba, linear attention, short convolutions, attention code of its own, absolute
positions it numbers per shard) is refused before its first forward computes anything
(:mod:`usp.models.hf_mixers`), whatever the order of the recipe: the model given to
``register``, or one built with the name afterwards (``from_pretrained(path,
attn_implementation=name)``: :mod:`usp.models.hf_watch` sees transformers build it). What
the model must be given: this rank's ``input_ids`` shard, the tokens' global ``position_ids`` (HF would
otherwise number the shard 0..S/P-1), ``use_cache=False``, and for packed documents
``usp_packed=plan.pack(cu_seqlens)`` or the global ``cu_seq_lens_q/k`` (forwarded to
every attention call). Do not pass ``labels=`` to the HF model under SP: its loss shifts
inside the shard and averages per rank.

Inputs are computed exactly or refused (:mod:`usp.models.hf_inputs`): a 2-D padding
mask is checked by a mask function registered with the name (zeros at the end of the
rows of a causal model in one process are exact; other padding is refused); HF's
padding-free packing (``cu_seq_lens_q/k``, or in one process ``position_ids`` that
restart per document) becomes usp's packed documents; ``is_causal`` (the module's, the
config's or a keyword) is respected; under ``torch.autocast`` q/k/v are computed in the
autocast dtype, as sdpa computes them; a module's ``head_chunks`` (set by
``usp.models.Levers``) goes to the ring; a vision-language model's encoders, multimodal
positions and mask overlays are computed or refused (:mod:`usp.models.hf_multimodal_checks`),
and :func:`shard_multimodal` shards a vision-language batch, its images spread over the SP
ranks (:mod:`usp.models.hf_multimodal`). :func:`shard_flattened` turns a
``DataCollatorWithFlattening`` batch into this rank's part (documents padded to the
layout, labels shifted per document, ``usp_packed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from usp.models.batch import ShardedBatch, shard_batch
from usp.models.hf_inputs import (
    CU_KWARGS,
    PACKED_KWARG,  # noqa: F401 - re-exported: usp.models.hf.PACKED_KWARG
    HFInputError,
    PackedInputs,
    PaddingSeen,
    padding_mask_function,
)
from usp.models.hf_mixers import (  # noqa: F401
    MixerCheck,
    TokenMixerError,
    check_model,
    swap_linear_attention,
)
from usp.models.hf_multimodal import MultimodalBatch, loss_body, shard_multimodal  # noqa: F401
from usp.models.hf_multimodal_checks import MultimodalChecks, is_encoder_config
from usp.models.hf_watch import watch_construction
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, loss_dtype, sp_cross_entropy, sp_normalise
from usp.sp.plan import as_plan
from usp.sp.sharding import pad_documents

_BUILTIN_PREFIXES = ("eager", "sdpa", "flash_attention", "flex_attention", "paged")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "usp.models.hf needs HF transformers: pip install transformers (or usp[hf])"
        ) from None
    return transformers


def register(plan, *, name: str = "usp", model=None, **attention_options) -> str:
    """Register USP attention in ``transformers.AttentionInterface`` under ``name`` and
    return the name. ``plan``: a Plan (or a Topology, or None for one process, made into a
    Plan here); ``attention_options`` (``layout``, ``ring_impl``, ``backend``) go into the
    plan. Registering a name again replaces it (transformers keeps one global table):
    use one name per plan.

    ``model`` (an already built model, the recipe's way): it is checked here and switched
    to the name (``model.set_attn_implementation(name)``). Without it, give the name as
    ``attn_implementation=`` to a model built afterwards (transformers checks the name
    when it builds the model).

    Also registers a usp mask function under ``name`` in transformers'
    ``AttentionMaskInterface`` (:func:`usp.models.hf_inputs.padding_mask_function`): it
    checks 2-D padding masks and builds no mask. A name that already has someone else's
    mask function is refused.

    Under SP (more than one SP rank) a model that mixes tokens outside attention (Mamba,
    linear attention, short convolutions, attention code of its own, absolute positions
    it numbers per shard: :mod:`usp.models.hf_mixers`) is refused with a
    :class:`~usp.models.hf_mixers.TokenMixerError` before its first forward computes
    anything, whatever the order: here when ``model`` is given; for a model built with
    the name, at its first call (:mod:`usp.models.hf_watch` sees it being built); for
    one switched to the name later, at its first mask or attention call, from a
    meta-device build of its config. Qwen3.5's Gated DeltaNet layers are computed by usp
    once :func:`swap_linear_attention` put its module in their place; pass that model
    here (the config alone describes transformers' layers, which are refused). A plan
    with ``placement="documents"`` is refused (the plug-in shards along the sequence)."""
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    plan = as_plan(plan, **attention_options)
    if plan.placement == "documents":  # a plan option: the same refusal on every rank
        raise ValueError(
            'usp.models.hf.register: a plan with placement="documents" (documents placed '
            "whole by length) is not supported by the HF plug-in yet: its batches, labels "
            "and positions are sharded along the sequence; build the plan with "
            'placement="sequence" (the default), or train a usp model family (usp train, '
            "usp.models.from_pretrained), which places documents"
        )
    if not isinstance(name, str) or not name or name.startswith(_BUILTIN_PREFIXES):
        raise ValueError(
            f"name {name!r} would shadow one of transformers' own attention implementations "
            f"({', '.join(_BUILTIN_PREFIXES)}...); choose another, e.g. 'usp'"
        )
    existing = AttentionMaskInterface._global_mapping.get(name)
    if existing is not None and getattr(existing, "usp_mask_for", None) != name:
        # someone else's mask function would build masks usp does not apply
        raise ValueError(
            f"name {name!r} has a mask function in transformers; choose a name without one"
        )
    # the mask function sees the 2-D padding mask (once per forward) and returns None
    check = MixerCheck(plan)
    if model is not None:
        check.accept(model)
    seen = PaddingSeen()
    multimodal = MultimodalChecks(plan, name)  # encoders, multimodal positions, overlays
    mask_function = padding_mask_function(plan, name, seen, check)
    AttentionMaskInterface.register(name, multimodal.wrap_mask_function(mask_function))
    attention = _attention_function(plan, name, seen, check, multimodal)
    attention.usp_plan, attention.usp_multimodal = plan, multimodal  # shard_multimodal's
    transformers.AttentionInterface.register(name, attention)
    watch_construction()  # models built with the name meet the check before their forward
    if model is not None:
        model.set_attn_implementation(name)
    return name


def _attention_function(
    plan, name: str, seen: PaddingSeen, check: MixerCheck, multimodal: MultimodalChecks
):
    packed_inputs = PackedInputs(plan, name)  # one PackedSequence per forward

    def usp_attention_forward(
        module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ):
        """query [B, H, S/P, D], key/value [B, Hkv, S/P, D] (after RoPE) ->
        (out [B, S/P, H, D], None)."""
        if is_encoder_config(getattr(module, "config", None)):  # a vision/audio tower
            return multimodal.encoder_attention(
                module, query, key, value, attention_mask, packed_inputs.agreed,
                dropout=dropout, scaling=scaling, is_causal=is_causal,
                sliding_window=sliding_window, softcap=softcap, **kwargs,
            )  # fmt: skip
        causal = seen.causal(module, is_causal, name)  # from the masks built before
        seen.close_group()  # the layers of this forward have started
        check(getattr(module, "config", None))  # the model mixes tokens only here (SP)
        unsupported = {
            "a 4-D attention_mask (or another prepared mask)": attention_mask is not None,
            f"dropout={dropout}": bool(dropout),
            f"softcap={softcap}": softcap is not None,
        }
        problems = [what for what, bad in unsupported.items() if bad]
        if problems:
            raise HFInputError(
                f"attn_implementation={name!r} (USP attention) does not support "
                f"{', '.join(problems)} in {type(module).__name__}: it computes exact "
                "causal or full attention (with a sliding window and attention sinks), with "
                "packed documents from usp_packed=plan.pack(cu) or cu_seq_lens_q/k, and "
                "checks 2-D padding masks itself"
            )
        if key.shape[2] != query.shape[2]:
            raise HFInputError(
                f"USP attention got {query.shape[2]} query tokens but {key.shape[2]} key "
                "tokens: call the model with use_cache=False (no KV cache under SP)"
            )
        if sliding_window is not None and not causal:
            raise HFInputError(
                f"attn_implementation={name!r} (USP attention) computes sliding windows of "
                f"causal attention only; {type(module).__name__} attends bidirectionally "
                f"(is_causal=False) within sliding_window={sliding_window}"
            )
        if not causal:
            seen.refuse_if_padded(
                plan,
                f"attn_implementation={name!r} (USP attention): this forward's attention_mask "
                f"has padding and {type(module).__name__} attends bidirectionally "
                "(is_causal=False): every real token would attend to the pads; give rows "
                "without padding, or pack them (DataCollatorWithFlattening, usp_packed)",
            )
        problem = multimodal.layer_problem(module, kwargs, causal)  # images, overlays
        batch, _, local_len, _ = query.shape
        config = getattr(module, "config", None)  # use_cache is refused under SP
        use_cache = bool(kwargs.get("use_cache")) or check.cache_requested(config)
        packed = packed_inputs(
            batch, local_len, query.device, {**kwargs, "use_cache": use_cache}, problem=problem
        )
        # [B, H, S/P, D] -> [B, S/P, H, D]; under autocast in its dtype, as sdpa is
        q, k, v, autocast_off = _as_sdpa_casts(query, key, value)
        with autocast_off:
            partial = multimodal.partial(kwargs, q, k, v, scaling, causal)  # image blocks
            out = plan.attention(
                q, k, v, causal=causal, softmax_scale=scaling, packed=packed,
                head_chunks=getattr(module, "head_chunks", 1),  # usp.models.Levers sets it
                window=sliding_window, sinks=kwargs.get("s_aux"),  # gpt-oss's sinks: s_aux
                **({} if partial is None else {"partial": partial}),
            )  # fmt: skip
        return out, None

    return usp_attention_forward


def _as_sdpa_casts(query, key, value):
    """q/k/v as ``[B, S/P, H, D]`` views, and the context to attend in.

    Under ``torch.autocast`` sdpa casts its three inputs to the autocast dtype (an HF
    model hands it float32 q/k after RoPE's float32 tables, v in the autocast dtype) and
    runs without autocast; USP attention does the same, so its float32 merge and the
    kernels' own dtype choices are not recast op by op. Outside autocast the inputs stay
    as they are (mixed dtypes are refused by the kernels, as sdpa refuses them)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return q, k, v, torch.autocast(device_type, enabled=False)


def shard_flattened(
    plan, batch: dict, *, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> ShardedBatch:
    """This rank's part of an HF padding-free batch (``DataCollatorWithFlattening`` /
    TRL ``padding_free=True``: ``input_ids`` [1, S], optional ``labels``, and the
    documents as ``cu_seq_lens_q/k`` or ``position_ids`` that restart per document).

    Every document is padded at its end to what the plan's layout needs
    (:func:`usp.pad_documents`; pads get ``pad_token_id`` and ignored labels), the labels
    are shifted per document on the global sequence and everything is sharded as
    :func:`usp.models.shard_batch` does; ``.hf_kwargs()`` then carries the packed
    documents as ``usp_packed``, and ``.real`` marks the tokens that are not such pads. Collective (``plan.pack``): every SP rank calls it with
    the same batch."""
    plan = as_plan(plan)
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise HFInputError(
            f"a padding-free batch has input_ids [1, S], got {tuple(input_ids.shape)}; "
            "flatten it with transformers.DataCollatorWithFlattening"
        )
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise HFInputError("a padding-free batch has no padding, but its attention_mask has zeros")
    cu = flattened_boundaries(batch, input_ids.shape[1])
    padding = pad_documents(cu, plan)
    ids = padding.apply(input_ids, pad_token_id)
    labels = batch.get("labels")
    labels = padding.apply(input_ids if labels is None else labels, ignore_index)
    sharded = shard_batch(
        plan, ids, labels=labels, cu_seqlens=padding.cu_seqlens, ignore_index=ignore_index
    )
    real = padding.apply(torch.ones_like(input_ids, dtype=torch.bool), False)  # [1, S']
    real = plan.shard(real, packed=sharded.packed).to(sharded.input_ids.device)
    return dataclasses.replace(sharded, real=real)


def flattened_boundaries(batch: dict, total: int) -> torch.Tensor:
    """The global int32 boundaries of a padding-free batch."""
    given = [batch.get(k) for k in CU_KWARGS if batch.get(k) is not None]
    if given:
        cu = given[0].to("cpu", torch.int32)
        if any(not torch.equal(cu, other.to("cpu", torch.int32)) for other in given[1:]):
            raise HFInputError("cu_seq_lens_q and cu_seq_lens_k of a padding-free batch differ")
        return cu
    positions = batch.get("position_ids")
    if positions is None:
        raise HFInputError(
            "a padding-free batch needs its documents: cu_seq_lens_q/k or position_ids that "
            "restart per document (DataCollatorWithFlattening gives both)"
        )
    starts = (torch.diff(positions.reshape(-1)) != 1).nonzero().flatten() + 1
    return torch.tensor([0, *starts.tolist(), total], dtype=torch.int32)


def sp_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    plan,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The SP-correct loss from an HF model's local logits [B, S/P, V] and this rank's
    shard of the *globally shifted* labels [B, S/P] (``usp.models.shard_batch`` or
    ``shift_labels`` then ``plan.shard``). Same contract as ``usp.models.Llama``: the
    global mean on every rank, gradients that sum over SP to the single-process ones."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the "
            f"vocabulary dim {tuple(logits.shape[:-1])}"
        )
    flat = logits.reshape(-1, logits.shape[-1]).to(loss_dtype(logits.dtype))
    local_sum = F.cross_entropy(
        flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    count = int((labels != ignore_index).sum())
    return sp_normalise(
        local_sum, count, as_plan(plan).sp_group, num_items_in_batch=num_items_in_batch
    )


#: the keyword of ``model(...)`` that asks an HF causal LM given :func:`add_loss_forward`
#: for the SP loss (a :class:`LossRequest`) instead of its logits
LOSS_KWARG = "usp_loss"


@dataclass(frozen=True)
class LossRequest:
    """What the loss forward of :func:`add_loss_forward` computes: the loss of
    :func:`usp.models.sp_cross_entropy` against this rank's shard of the globally
    shifted ``labels`` [B, S/P], over the SP ``group``."""

    labels: torch.Tensor
    group: object = None
    ignore_index: int = IGNORE_INDEX
    chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
    num_items_in_batch: int | float | torch.Tensor | None = None
    #: a mixture-of-experts model's term added to the loss: called with the decoder's
    #: router logits (one [B*S/P, E] tensor per MoE layer); None: the cross-entropy alone
    router_aux: Callable[[tuple], torch.Tensor] | None = None


def causal_lm_loss(
    model,
    batch: ShardedBatch,
    plan,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    router_aux: Callable[[tuple], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The SP-correct loss of an HF causal LM without materialising its logits: the
    decoder (``model.get_decoder()``) and the chunked loss against the output embedding,
    run inside the model's own forward (:func:`add_loss_forward`, given on the first
    call), so that hooks around it (FSDP2's gathers, autocast wrappers) apply. For
    models whose logits are ``lm_head(hidden)`` (no softcapping or scaling: Llama,
    Qwen2/3, Mistral). ``router_aux``: see :class:`LossRequest`."""
    if batch.labels is None:
        raise ValueError("batch has no labels: build it with shard_batch(..., with_labels=True)")
    add_loss_forward(model)
    request = LossRequest(
        batch.labels,
        as_plan(plan).sp_group,
        ignore_index=ignore_index,
        chunk_tokens=chunk_tokens,
        num_items_in_batch=num_items_in_batch,
        router_aux=router_aux,
    )
    return model(**batch.hf_kwargs(), **{LOSS_KWARG: request})


def check_chunked_loss(model) -> None:
    """A ValueError when ``model``'s logits are more than ``lm_head(hidden)`` (softcapping,
    scaling, a bias), which the chunked loss would leave out."""
    config = model.config.get_text_config()  # a vision-language model's: its text part's
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits ({attr}); use sp_loss on "
                "its logits instead of the chunked loss (loss_chunk_tokens=None)"
            )
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            "the chunked loss needs an output projection without bias; use sp_loss on the "
            "logits (loss_chunk_tokens=None)"
        )


def add_loss_forward(model):
    """Give an HF causal LM's ``forward`` the keyword :data:`LOSS_KWARG`: with a
    :class:`LossRequest` it returns the SP loss (decoder, then the chunked loss against
    the output embedding's weight, read inside the forward: under FSDP2 the gathered
    one); without it, the forward is the model's own. In place (an instance attribute,
    as TRL's fused head and accelerate's autocast wrap it); returns the model. The
    signature seen by ``inspect`` stays the model's. Idempotent."""
    if getattr(model, "usp_loss_forward", False):
        return model
    check_chunked_loss(model)
    inner = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, usp_loss: LossRequest | None = None, **kwargs):
        if usp_loss is None:
            return inner(*args, **kwargs)
        if usp_loss.router_aux is not None:
            kwargs["output_router_logits"] = True
        body, kwargs = loss_body(self, kwargs)  # a vision-language batch: its media encoded
        out = body(*args, **kwargs)
        loss = sp_cross_entropy(
            out.last_hidden_state,  # [B, S/P, dim]
            self.get_output_embeddings().weight,
            usp_loss.labels,
            usp_loss.group,
            ignore_index=usp_loss.ignore_index,
            chunk_tokens=usp_loss.chunk_tokens,
            num_items_in_batch=usp_loss.num_items_in_batch,
        )
        if usp_loss.router_aux is not None:
            loss = loss + usp_loss.router_aux(out.router_logits).to(loss.dtype)
        return loss

    model.forward = types.MethodType(forward, model)
    model.usp_loss_forward = True
    return model

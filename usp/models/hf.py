"""HF transformers models under USP: an attention function for transformers'
``AttentionInterface`` and the loss an HF user needs.

    plan = usp.Plan(topology)
    name = usp.models.hf.register(plan)               # before building the model
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    batch = usp.models.shard_batch(plan, input_ids)   # global -> this rank's shard
    logits = model(**batch.hf_kwargs()).logits        # [B, S/P, V]
    loss = usp.models.hf.sp_loss(logits, batch.labels, plan)
    # or, without materialising logits:
    loss = usp.models.hf.causal_lm_loss(model, batch, plan)

Every model that calls attention through ``AttentionInterface`` (Llama, Qwen2/3,
Mistral without sliding window, ...) runs this way. What the model must be given:
this rank's ``input_ids`` shard, the tokens' global ``position_ids`` (HF would otherwise
number the shard 0..S/P-1), ``use_cache=False``, and for packed documents
``usp_packed=plan.pack(cu_seqlens)`` (forwarded to every attention call). Do not pass
``labels=`` to the HF model: its loss shifts inside the shard and averages per rank.
No attention mask is used: a 2-D padding mask is ignored by transformers for a custom
attention name, so pad at the end with ignored labels (causal models never look ahead).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from usp.models.batch import ShardedBatch
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, loss_dtype, sp_cross_entropy, sp_normalise
from usp.plan import as_plan

#: the keyword of ``model(...)`` that carries a ``usp.PackedSequence`` to the attention
PACKED_KWARG = "usp_packed"
_BUILTIN_PREFIXES = ("eager", "sdpa", "flash_attention", "flex_attention", "paged")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "usp.models.hf needs HF transformers: pip install transformers (or usp[hf])"
        ) from None
    return transformers


def register(topology, *, name: str = "usp", **attention_options) -> str:
    """Register USP attention in ``transformers.AttentionInterface`` under ``name`` and
    return the name (give it as ``attn_implementation=``; register before building the
    model). ``topology``: a Topology, a Plan or None; ``attention_options`` (``layout``,
    ``ring_impl``, ``backend``) go into the plan. Registering a name again replaces it
    (transformers keeps one global table): use one name per plan."""
    transformers = _transformers()
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:  # transformers before the mask-function table: no masks to collide
        ALL_MASK_ATTENTION_FUNCTIONS = {}

    plan = as_plan(topology, **attention_options)
    if not isinstance(name, str) or not name or name.startswith(_BUILTIN_PREFIXES):
        raise ValueError(
            f"name {name!r} would shadow one of transformers' own attention implementations "
            f"({', '.join(_BUILTIN_PREFIXES)}...); choose another, e.g. 'usp'"
        )
    if name in ALL_MASK_ATTENTION_FUNCTIONS:
        # a mask function would read zigzag position_ids as document starts: wrong masks
        raise ValueError(
            f"name {name!r} has a mask function in transformers; choose a name without one"
        )
    transformers.AttentionInterface.register(name, _attention_function(plan, name))
    return name


def _attention_function(plan, name: str):
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
        **kwargs,
    ):
        """query [B, H, S/P, D], key/value [B, Hkv, S/P, D] (after RoPE) ->
        (out [B, S/P, H, D], None)."""
        unsupported = {
            "attention_mask": attention_mask is not None,
            f"dropout={dropout}": bool(dropout),
            f"sliding_window={sliding_window}": sliding_window is not None,
            f"softcap={softcap}": softcap is not None,
            "attention sinks (s_aux)": kwargs.get("s_aux") is not None,
        }
        problems = [what for what, bad in unsupported.items() if bad]
        if problems:
            raise ValueError(
                f"attn_implementation={name!r} (USP attention) does not support "
                f"{', '.join(problems)} in {type(module).__name__}: it computes exact "
                "causal or full attention (packed documents via usp_packed=plan.pack(...))"
            )
        if key.shape[2] != query.shape[2]:
            raise ValueError(
                f"USP attention got {query.shape[2]} query tokens but {key.shape[2]} key "
                "tokens: call the model with use_cache=False (no KV cache under SP)"
            )
        out = plan.attention(
            query.transpose(1, 2),  # [B, H, S/P, D] -> [B, S/P, H, D]
            key.transpose(1, 2),
            value.transpose(1, 2),
            causal=bool(getattr(module, "is_causal", True)),
            softmax_scale=scaling,
            packed=kwargs.get(PACKED_KWARG),  # a PackedSequence (or global cu_seqlens)
        )
        return out, None

    return usp_attention_forward


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


def causal_lm_loss(
    model,
    batch: ShardedBatch,
    plan,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The SP-correct loss of an HF causal LM without materialising its logits: runs the
    decoder (``model.get_decoder()``) and the chunked loss against the output
    embedding. For models whose logits are ``lm_head(hidden)`` (no softcapping or
    scaling: Llama, Qwen2/3, Mistral)."""
    if batch.labels is None:
        raise ValueError("batch has no labels: build it with shard_batch(..., with_labels=True)")
    config = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits ({attr}); use sp_loss on "
                "its logits instead of causal_lm_loss"
            )
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("causal_lm_loss needs an output projection without bias; use sp_loss")
    kwargs = batch.hf_kwargs()
    hidden = model.get_decoder()(**kwargs).last_hidden_state  # [B, S/P, dim]
    return sp_cross_entropy(
        hidden,
        head.weight,
        batch.labels,
        as_plan(plan).sp_group,
        ignore_index=ignore_index,
        chunk_tokens=chunk_tokens,
        num_items_in_batch=num_items_in_batch,
    )

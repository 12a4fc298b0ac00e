"""Every causal-LM type of the installed transformers, built tiny, through the HF plug-in
under sequence parallelism against the same model in one process.

:func:`tiny_config` shrinks a type's default config by field name (layers, widths, heads,
experts, every vocabulary; SSM and linear-attention widths per type: a type left at a
default width cost up to 25 s of the sweep, Gemma 4's 262,144 x 256 per-layer
embeddings); :func:`sweep_outcomes` runs a list of types on the SP ranks of a plan with the
README's recipe (``register(plan)``, the model built with the returned name,
``shard_batch``, ``model(**batch.hf_kwargs())``, ``plan.gather``, ``sp_loss``) and
compares each with transformers' own attention in one process: logits and every
parameter gradient (summed over the SP ranks). An outcome is ``("exact", errors)``,
``("refused", error class, message)``, ``("wrong", errors)``, ``("crashed", error class,
message)`` (an error that is not usp's) or ``("skipped", why)`` for a type that does not
build tiny or does not run on plain ``input_ids`` in one process either.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import re
import warnings

import torch
import torch.distributed as dist

#: field name -> the tiny value (only ever lowers an int field)
SHRINK = (
    (r"(num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|"
     r"num_decoder_layers|num_encoder_layers)", 2),
    (r"(hidden_size|d_model|n_embd|embed_dim|emb_dim|dim|model_dim|word_embed_proj_dim)", 32),
    (r"(hidden_size_per_layer_input)", 8),
    (r"(intermediate_size|ffn_dim|n_inner|d_ff|decoder_ffn_dim|encoder_ffn_dim|"
     r"ffn_hidden_size|moe_intermediate_size|shared_intermediate_size|"
     r"expert_intermediate_size|shared_expert_intermediate_size)", 32),
    (r"(num_attention_heads|n_head|n_heads|num_heads|decoder_attention_heads|"
     r"encoder_attention_heads)", 4),
    (r"(num_key_value_heads|n_kv_heads|num_kv_heads|multi_query_group_num)", 2),
    (r"(head_dim|attention_head_dim|kv_channels)", 8),
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)", 4),
    (r"(num_experts_per_tok|moe_top_k|moe_k|n_activated_experts|num_experts_per_token)", 2),
    (r"(qk_nope_head_dim|qk_rope_head_dim|v_head_dim|rotary_dim)", 8),
    (r"(kv_lora_rank|q_lora_rank)", 16),
    (r"(n_group|topk_group)", 1),
)  # fmt: skip
_SHRINK = tuple((re.compile(f"^{pattern}$"), value) for pattern, value in SHRINK)
SEQ = 16
VOCAB = 128
#: what the rules above cannot derive: fields that must agree with each other, and
#: defaults that do not build (DBRX reads attn_config.rope_theta, absent by default)
OVERRIDES = {
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1),
    # the SSM and linear-attention widths the rules above do not name (their defaults:
    # 128 heads, states of 128-256, chunks of 128-256; seconds per type)
    "falcon_h1": dict(
        mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32, mamba_d_state=16, mamba_chunk_size=16
    ),
    "nemotron_h": dict(
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=16,
        moe_shared_expert_intermediate_size=32,
    ),
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16]),
    "hunyuan_v1_dense": dict(head_dim=8),
    "hunyuan_v1_moe": dict(head_dim=8),
    "ministral": dict(head_dim=8),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "nemotron": dict(num_key_value_heads=2),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"]),
    "kolibri1_1": dict(head_dim=16),
    "dbrx": dict(
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    ),
}
#: logits and gradients (float32, tiny models) within this of one process, relative to
#: the reference's largest magnitude (at least 1)
TOL = 1e-4


def _shrunk(config) -> dict:
    """The field changes that make ``config`` tiny (sub-configs shrunk on copies)."""
    changes = {}
    fields = dataclasses.fields(config) if dataclasses.is_dataclass(config) else ()
    values = {f.name: _field(config, f.name) for f in fields}
    for name, value in values.items():
        if dataclasses.is_dataclass(value) and hasattr(value, "to_dict"):  # a sub-config
            value = copy.deepcopy(value)
            for key, small in _shrunk(value).items():
                setattr(value, key, small)
            changes[name] = value
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        for pattern, small in _SHRINK:
            if pattern.match(name) and value > small:
                changes[name] = small
        if _extra_vocabulary(name) and value > VOCAB:  # hashed, grouped or per-layer ones
            changes[name] = VOCAB
    layers = values.get("num_hidden_layers")
    if isinstance(layers, int) and "num_hidden_layers" in changes:
        kinds = values.get("layer_types")
        keep = list(range(changes["num_hidden_layers"]))
        if isinstance(kinds, list) and len(kinds) == layers:  # one layer of every kind
            first = sorted({kinds.index(kind) for kind in kinds})
            others = [i for i in range(layers) if i not in first]
            keep = sorted(first + others[: max(0, 2 - len(first))])
            changes["num_hidden_layers"] = len(keep)
        for name, value in values.items():  # per-layer lists (layer_types and kin)
            if isinstance(value, list) and len(value) == layers and name not in changes:
                changes[name] = [value[i] for i in keep]
    if isinstance(values.get("kv_lora_rank"), int):  # MLA: as many key heads as query heads
        changes["num_key_value_heads"] = changes.get("num_attention_heads", 4)
    vocab = values.get("vocab_size")
    if isinstance(vocab, int) and vocab > VOCAB:
        changes["vocab_size"] = VOCAB
        tokens = [name for name in values if name.endswith("_token_id")]
        for index, name in enumerate(tokens):
            if isinstance(values[name], int) and values[name] >= VOCAB:
                changes[name] = VOCAB - 1 - index
    return changes


def _extra_vocabulary(name: str) -> bool:
    """A vocabulary beside ``vocab_size`` (hashed or grouped ``*_vocab``, Gemma 4's
    ``vocab_size_per_layer_input``, ``unpadded_vocab_size``)."""
    return name.endswith(("_vocab", "_vocab_size")) or name.startswith("vocab_size_")


def _field(config, name):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - per-layer attributes that refuse a global read
        return None


def tiny_config(model_type: str, **extra):
    """``model_type``'s default config with its sizes lowered (SHRINK's fields, the
    vocabulary, in its sub-configs too), then ``extra``."""
    from transformers import AutoConfig

    changes = _shrunk(AutoConfig.for_model(model_type))
    changes.update(OVERRIDES.get(model_type, {}), **extra)
    return AutoConfig.for_model(model_type, **changes)


def build(model_type: str, *, seed: int = 0, config_changes=None, **kwargs):
    """The tiny causal LM in float32, eval mode (no dropout), weights from ``seed``;
    ``kwargs`` go to ``from_config`` (``attn_implementation``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type, **(config_changes or {}))
    return AutoModelForCausalLM.from_config(config, **kwargs).float().eval()


def token_ids(config) -> torch.Tensor:
    """[1, SEQ] ids below the vocabulary, none a special token of ``config``."""
    special = set()
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, field, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    vocab = getattr(config, "vocab_size", None) or VOCAB
    allowed = [i for i in range(min(vocab, 64)) if i not in special]
    gen = torch.Generator().manual_seed(5)
    picks = torch.randint(0, len(allowed), (1, SEQ), generator=gen)
    return torch.tensor(allowed)[picks]


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum"
    )


def reference(model_type: str, ids) -> dict:
    """One process, transformers' own attention: logits [1, S, V] and every gradient of
    the summed next-token loss."""
    from usp.models import shift_labels

    model = build(model_type)
    positions = torch.arange(ids.shape[1])[None]
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    _loss(logits, shift_labels(ids)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "grads": grads}


def under_sp(model_type: str, plan, name: str, ids, *, given: bool) -> dict:
    """The README's recipe on this rank: the model built, then given to
    ``register(plan, model=model)`` (``given``), or built with the name ``register(plan)``
    returned; its shard of the batch, the gathered logits and the SP-summed gradients."""
    from usp.models import hf as usp_hf
    from usp.models import shard_batch

    if given:
        model = build(model_type)
        usp_hf.register(plan, name=f"{name}_given", model=model)
    else:
        model = build(model_type, attn_implementation=name)
    batch = shard_batch(plan, ids)
    logits = model(**batch.hf_kwargs()).logits  # [1, S/P, V]
    _loss(logits, batch.labels).backward()
    grads = {}
    for param_name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.clone()
            dist.all_reduce(grad, group=plan.sp_group)
            grads[param_name] = grad
    return {"logits": plan.gather(logits.detach()), "grads": grads}


def errors(got: dict, want: dict) -> dict:
    """The largest differences, each relative to the reference's largest magnitude (at
    least 1): logits, then the worst gradient (by name), and gradients one side lacks."""

    def error(a, b):
        return (a - b).abs().max().item() / max(1.0, b.abs().max().item())

    worst, name = 0.0, None
    for param_name, grad in want["grads"].items():
        other = got["grads"].get(param_name)
        diff = float("inf") if other is None else error(other, grad)
        if diff >= worst:
            worst, name = diff, param_name
    extra = sorted(set(got["grads"]) - set(want["grads"]))
    logits = error(got["logits"], want["logits"])
    return {"logits": logits, "grad": worst, "grad_of": name, "extra_grads": extra}


def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    return stack


def prepared(model_type: str, with_reference: bool):
    """``(ids, reference or None)`` of this type on this rank, or why it does not build
    tiny or run on plain ``input_ids`` in one process (a str). Collective-free: the
    ranks compute their shares of the references side by side before the sweep's
    first collective."""
    with _quiet():
        try:
            ids = token_ids(tiny_config(model_type))
            return ids, (reference(model_type, ids) if with_reference else None)
        except Exception as err:  # noqa: BLE001 - a type that does not run tiny here
            return f"{type(err).__name__}: {str(err)[:200]}"


def outcome(model_type: str, plan, name: str, ids, want: dict | None, given: bool):
    """This type's outcome on this rank (every SP rank calls it with the same ``ids``;
    the rank holding the one-process reference ``want`` also gives the verdict, the
    others return ``None`` for a model that ran; ``given``: see :func:`under_sp`)."""
    from usp.errors import UspError

    with _quiet():
        try:
            got = under_sp(model_type, plan, name, ids, given=given)
        except UspError as err:
            return ("refused", type(err).__name__, str(err))
        except Exception as err:  # noqa: BLE001 - reported: neither exact nor refused
            return ("crashed", type(err).__name__, str(err)[:500])
    if want is None:
        return None
    found = errors(got, want)
    exact = found["logits"] <= TOL and found["grad"] <= TOL and not found["extra_grads"]
    return ("exact" if exact else "wrong", found)


def given_to_register(index: int) -> bool:
    """Whether the sweep's ``index``-th type is built first and given to ``register``
    (odd), or built with the name (even): both orders of the recipe, half the types each."""
    return index % 2 == 1


def sweep_outcomes(plan, name: str, model_types) -> dict:
    """Every type's outcome, the same dict on every SP rank. First every rank builds
    each type's ids and its share of the one-process references (every
    ``sp_degree``-th type), all ranks side by side with no collective in between (a
    reference, and the first import of a model's module, never keeps the other ranks
    waiting); one exchange then skips, on every rank, a type that failed there on any
    rank; then each remaining type runs under SP and the rank holding its reference
    gives the verdict; the ranks share their verdicts."""
    degree, sp_rank = plan.sp_degree, dist.get_rank(plan.sp_group)
    ready = {t: prepared(t, i % degree == sp_rank) for i, t in enumerate(model_types)}
    skips = [None] * degree
    dist.all_gather_object(skips, {t: r for t, r in ready.items() if isinstance(r, str)},
                           group=plan.sp_group)  # fmt: skip
    mine = {}
    for index, model_type in enumerate(model_types):
        why = [s[model_type] for s in skips if model_type in s]
        if why:
            mine[model_type] = ("skipped", why[0])
            continue
        ids, want = ready[model_type]
        mine[model_type] = outcome(model_type, plan, name, ids, want, given_to_register(index))
    everyone = [None] * degree
    dist.all_gather_object(everyone, mine, group=plan.sp_group)
    merged = {}
    for model_type in model_types:
        seen = [rank_outcomes[model_type] for rank_outcomes in everyone]
        ran = [s for s in seen if s is not None]
        kinds = {s[0] for s in ran}
        if kinds <= {"exact", "wrong"}:
            merged[model_type] = ran[0] if len(ran) == 1 else ("disagree", seen)
        elif len({repr(s) for s in seen}) == 1:
            merged[model_type] = seen[0]
        else:
            merged[model_type] = ("disagree", seen)
    return merged

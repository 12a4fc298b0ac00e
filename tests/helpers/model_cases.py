"""Shared pieces of the usp.models tests: one tiny Llama config, checkpoints written by
HF transformers into temporary directories, global batches, and the single-process
float64 reference computed by transformers itself."""

from __future__ import annotations

import types
from pathlib import Path

import torch
import torch.nn.functional as F

#: one tiny shape for every test: 8 query heads / 2 KV heads (KV replication at
#: ulysses 4 and 8), head_dim given explicitly and != hidden / heads
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    initializer_range=0.1,
)
#: the three-layer shape of the Gemma 3 and Qwen3.5 checkpoints (gemma3_cases,
#: qwen3_5_cases): 4 query / 2 KV heads, head_dim 8 != hidden / heads
THREE_LAYERS = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # short, so that the tiny sequences reach the scaled band of frequencies
    "original_max_position_embeddings": 16,
}
#: YaRN with every optional key that changes the result (attention scaling from mscale)
YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "mscale": 1.2,
    "mscale_all_dim": 0.6,
}
IGNORE = -100

#: per model family: transformers' config class and the tiny shape's family settings,
#: each away from the family's defaults where one changes the computation
FAMILY_CASES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v biases
    # per-head q/k norms; head_dim 8 != hidden / heads = 4; biases on all four projections
    "qwen3": ("Qwen3Config", {"attention_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),  # a window longer than any sequence
    # 4 experts, top 2 renormalised; layer 0 dense (mlp_only_layers), layer 1 sparse
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "attention_bias": True,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # 4 experts, top 2; layer 0 slides over 6 keys, layer 1 full; sinks; default YaRN;
    # a low swiglu_limit (so that the clamps bind) and another alpha
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 6,
            "swiglu_limit": 0.5,
            "swiglu_alpha": 1.5,
        },
    ),
}


def family_config(family: str, **changes):
    """usp's config of the tiny shape in ``family``."""
    from usp.models import family_named

    _, extras = FAMILY_CASES[family]
    return family_named(family).config_class(**{**TINY, **extras, **changes})


def write_family_checkpoint(directory: Path, family: str, *, seed=0, tied=False, **changes):
    """A random tiny model of ``family`` saved by transformers (float32 safetensors), with
    norm weights away from 1 and random biases, so that no gradient is trivial."""
    import transformers

    class_name, extras = FAMILY_CASES[family]
    config = getattr(transformers, class_name)(
        **{**TINY, **extras, **changes}, tie_word_embeddings=tied
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return Path(directory)


def hf_config(*, tied=False, rope_scaling=None, **changes):
    import transformers

    # a copy: transformers writes rope_theta into the dict it is given
    scaling = None if rope_scaling is None else dict(rope_scaling)
    return transformers.LlamaConfig(
        **{**TINY, **changes}, tie_word_embeddings=tied, rope_scaling=scaling
    )


def write_hf_checkpoint(directory: Path, *, tied=False, rope_scaling=None, seed=0, **save_kwargs):
    """A random tiny LlamaForCausalLM saved by transformers (float32 safetensors), with
    norm weights away from 1 so that their gradients are not trivial."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(tied=tied, rope_scaling=rope_scaling))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    model.save_pretrained(directory, **save_kwargs)
    return Path(directory)


def _rms_norm_float64(self, x):
    """HF's RMSNorm normalises in float32 even for float64 inputs; the float64 reference
    normalises in float64 (same formula)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def one_plus_weight_norm_float64(self, x):
    """transformers' Gemma 3 and Qwen3.5 RMSNorm (scaled by 1 + weight, normalised in
    float32 whatever the dtype) in float64: the same formula."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def router_float64(self, hidden_states):
    """HF's MoE routers take the softmax in float32 even for float64 inputs; the float64
    reference takes it in float64 (same formula as Qwen3MoeTopKRouter.forward)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)
    top_value, indices = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, indices


def load_hf_reference(directory: Path, dtype=torch.float64, attn_implementation=None):
    """transformers' own model from ``directory`` (any family): float64, SDPA attention
    (float64 all through; eager's softmax is float32) or, for a model without SDPA
    (gpt-oss), eager attention (its softmax in the input's dtype), RMSNorm in float64; MoE experts
    by transformers' loop ("eager": its grouped GEMM has no float64) and the router's
    softmax in float64. Hub kernels stay off (``use_kernels=False``): the reference is
    transformers' own PyTorch code, and from 5.25 on (``kernels`` installed with it, on by
    default) ``model.train()`` re-kernelizes the model, which deletes the float64 forwards
    set on its RMSNorm instances below -- their float32 normalisation came back (8.5e-9)."""
    import transformers

    if attn_implementation is None:
        config = transformers.AutoConfig.from_pretrained(directory)
        model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        attn_implementation = "sdpa" if model_class._supports_sdpa else "eager"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attn_implementation,
        experts_implementation="eager", use_kernels=False,
    )  # fmt: skip
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_float64, module)
            elif type(module).__name__.endswith("TopKRouter") and hasattr(
                module, "norm_topk_prob"
            ):  # (gpt-oss's router computes in the logits' dtype: float64 already)
                module.forward = types.MethodType(router_float64, module)
    return model


def hf_reference(directory: Path, input_ids, labels, cu_seqlens=None) -> dict:
    """:func:`transformers_reference` of transformers' float64 model in ``directory``."""
    return transformers_reference(load_hf_reference(directory), input_ids, labels, cu_seqlens)


def transformers_reference(model, input_ids, labels, cu_seqlens=None) -> dict:
    """A loaded float64 transformers model's logits [B, S, V], mean loss over the
    non-ignored labels, and every parameter's gradient (HF names). Packed sequences run
    document by document. A model whose config sets ``output_router_logits`` adds
    ``router_aux_loss_coef`` x the load-balancing loss over every document's tokens
    (closed form: transformers' own sums it in float32)."""
    moe = bool(getattr(model.config, "output_router_logits", False))
    router = {"output_router_logits": True} if moe else {}
    bounds = [0, input_ids.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs = [model(input_ids[:, a:b], use_cache=False, **router) for a, b in zip(bounds, bounds[1:])]
    logits = torch.cat([out.logits for out in outs], dim=1)
    count = (labels != IGNORE).sum()
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    loss = total / count.clamp(min=1)
    if moe:
        cfg = model.config
        logits_of_routers = [layer for out in outs for layer in out.router_logits]
        aux = closed_form_aux(logits_of_routers, cfg.num_experts, cfg.num_experts_per_tok)
        loss = loss + cfg.router_aux_loss_coef * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads}


def closed_form_aux(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """The load-balancing loss as transformers writes it (Switch Transformer, no attention
    mask) in float64 over a list of router logits [tokens, E] (every layer, every
    document): E * sum_e (share of top-k assignments to e) * (mean router probability)."""
    logits = torch.cat(list(router_logits))  # [rows, E]
    probs = torch.softmax(logits, dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices
    assigned = F.one_hot(chosen, num_experts).sum(1).double()  # [rows, E]
    return num_experts * (assigned.mean(0) * probs.mean(0)).sum()


def global_batch(batch, seq_len, *, seed=0, vocab=TINY["vocab_size"]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=gen)


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def sft_labels(input_ids, prompt_lengths, cu_seqlens=None):
    """Globally shifted labels with each document's first ``prompt_lengths[i]`` tokens
    (the prompt) ignored, as in supervised fine-tuning."""
    from usp.models import shift_labels

    masked = input_ids.clone()
    starts = [0] if cu_seqlens is None else cu_seqlens.tolist()[:-1]
    for start, prompt in zip(starts, prompt_lengths):
        masked[..., start : start + prompt] = IGNORE
    return shift_labels(masked, cu_seqlens=cu_seqlens)


def relative_error(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def grad_errors(actual: dict, expected: dict) -> dict:
    missing = set(expected) ^ set(actual)
    assert not missing, f"parameter names differ from HF's: {sorted(missing)}"
    return {n: relative_error(actual[n], expected[n]) for n in expected}


def rope_and_dtype(written: dict) -> dict:
    """An exported config.json's RoPE and dtype in one form whichever transformers wrote
    it: ``{"rope_theta", "rope_scaling" (None: plain), "dtype"}`` (5.x writes
    ``rope_parameters`` and ``dtype``, 4.x ``rope_theta``/``rope_scaling``/``torch_dtype``)."""
    if "rope_parameters" in written:
        params = dict(written["rope_parameters"])
        theta = params.pop("rope_theta")
        scaling = None if params.get("rope_type", "default") == "default" else params
    else:
        theta, scaling = written["rope_theta"], written.get("rope_scaling")
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "dtype": written.get("dtype", written.get("torch_dtype")),
    }

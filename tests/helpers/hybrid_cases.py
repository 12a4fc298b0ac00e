"""Tiny transformers models of every hybrid architecture (token mixers besides attention)
and of a few that mix tokens only in attention, for the HF plug-in's exact-or-refused
tests. Each builds and runs on CPU in float32 in well under a second."""

from __future__ import annotations

import torch

#: the shape every case shares (hidden 32, 4 query / 2 KV heads of 8, 2 layers)
COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
)  # fmt: skip

#: model type -> the settings that make it tiny and hybrid (one non-attention layer, one
#: attention layer, where the architecture alternates them)
HYBRID = {
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    ),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32,
    ),
    "bamba": dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2,
    ),
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_dt_rank=4,
        mamba_expand=2, use_mamba_kernels=False,
    ),
    "falcon_h1": dict(
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2,
        mamba_d_ssm=64,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_ff_dim=32,
                 block_auto_adjust_ff_dim=False),
    "kimi_linear": dict(
        pad_token_id=0, num_key_value_heads=4,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "head_dim": 8,
                            "num_heads": 4, "short_conv_kernel_size": 4},
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8,
    ),
    "zamba2": dict(
        layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_headdim=8,
        n_mamba_heads=8, mamba_expand=2, num_mem_blocks=1, hybrid_layer_ids=[1],
        use_mem_rope=True, attention_hidden_size=64, attention_head_dim=16,
    ),
    "nemotron_h": dict(
        layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=1, expand=2,
    ),
    "minimax": dict(
        layer_types=["linear_attention", "full_attention"], num_local_experts=2,
        num_experts_per_tok=1, block_size=16,
    ),
    "recurrent_gemma": dict(
        block_types=["recurrent", "attention"], lru_width=32, attention_window_size=256,
        conv1d_width=4, num_key_value_heads=1,
    ),
}  # fmt: skip

#: model types whose only token mixer is the attention usp computes: they must run
#: exactly under SP (LFM2 with attention layers only; a mixture of experts; Nemotron-H
#: without Mamba layers)
TOKEN_LOCAL = {
    "llama": {},
    "lfm2": dict(layer_types=["full_attention", "full_attention"], block_ff_dim=32,
                 block_auto_adjust_ff_dim=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    # Nemotron-H with attention and MLP layers only ("mlp" is a token-local layer kind)
    "nemotron_h": dict(layers_block_type=["attention", "mlp"], mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, n_groups=1, expand=2),
}  # fmt: skip


def config(model_type: str, settings: dict, **changes):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **settings, **changes})


def build(model_type: str, settings: dict, *, seed: int = 0, **changes):
    """The tiny causal LM, float32, eval mode, weights from ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(model_type, settings, **changes))
    return model.float().eval()


def reference_by_document(model_type: str, settings: dict, ids, dlogits, bounds):
    """transformers' own model (:func:`build`) on each document of ``bounds`` alone, its
    logits concatenated and ``(logits * dlogits).sum()`` backpropagated: (the model, the
    logits, every parameter's gradient by name)."""
    model = build(model_type, settings)
    logits = torch.cat(
        [model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(bounds, bounds[1:])],
        dim=1,
    )  # one document at a time
    (logits * dlogits).sum().backward()
    return model, logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def swap_batch(plan, layout: str, packed: bool, seed: int, lowest_id: int):
    """The swap tests' global batch: (cu_seqlens or None, ids [1, S], dlogits [1, S, 64]);
    packed: three documents of 7, 13 and 3 tokens, padded for ``plan``'s grid; dense: 16
    tokens. Token ids from ``lowest_id`` to 63."""
    import usp

    gen = torch.Generator().manual_seed(seed)
    if packed:
        raw = torch.tensor([0, 7, 20, 23], dtype=torch.int32)
        cu = usp.pad_documents(raw, plan.topology, layout=layout).cu_seqlens
        seq = int(cu[-1])
    else:
        cu, seq = None, 16
    ids = torch.randint(lowest_id, 64, (1, seq), generator=gen)
    dlogits = torch.randn(1, seq, 64, generator=gen)
    return cu, ids, dlogits

"""Tiny Qwen3.5 text checkpoints written by transformers and their float64 reference
(tests/models/test_qwen3_5.py, tests/train/test_train_qwen3_5.py), dense and MoE.

transformers 5.24 computes Qwen3.5's norms, the GDN decay and its recurrence in float32
even in a float64 model. The float64 reference is transformers' model with those parts
in float64: its zero-centred RMSNorm and the MoE router's softmax by the same formulas, and each Gated DeltaNet
layer's forward by transformers' projections and order of operations around an
independent core (``F.conv1d`` and the token-by-token recurrence, :mod:`gdn_cases`).
``test_qwen3_5`` checks the patched forward against the unpatched one in float32.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from gdn_cases import reference_gdn
from model_cases import THREE_LAYERS, one_plus_weight_norm_float64

TINY = dict(
    THREE_LAYERS,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
CASES = {
    # explicit kinds, half of each head rotated, tied, a pad token
    "tied": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000.0,
            "partial_rotary_factor": 0.5,
        },
        tie_word_embeddings=True,
        pad_token_id=0,
    ),  # fmt: skip
    # the default pattern (interval 2: linear, full, linear), a quarter rotated, biases,
    # a conv kernel of 3, untied
    "biased": dict(
        full_attention_interval=2,
        attention_bias=True,
        linear_conv_kernel_dim=3,
        tie_word_embeddings=False,
    ),
}


def hf_text_config(case: str, **changes):
    return _transformers().Qwen3_5TextConfig(**{**TINY, **CASES[case], **changes})


def randomise(model) -> None:
    """Norm weights, biases, decays away from their initial values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("norm.weight", ".bias", "dt_bias")):
                param.copy_(0.3 * torch.randn_like(param))


def write_checkpoint(directory, case: str, *, seed=0, **changes):
    torch.manual_seed(seed)
    model = _transformers().Qwen3_5ForCausalLM(hf_text_config(case, **changes))
    randomise(model)
    model.save_pretrained(directory)
    return directory


def gdn_forward_float64(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """transformers' Qwen3_5GatedDeltaNet.forward in float64 for one document: its
    projections, split and gated norm; the conv and the recurrence by
    :func:`gdn_cases.reference_gdn`."""
    assert cache is None
    batch, seq_len, _ = hidden_states.shape
    qkv = self.in_proj_qkv(hidden_states)
    q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = (t.unflatten(-1, (self.num_k_heads, self.head_k_dim)) for t in (q, k))
    v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
    z = self.in_proj_z(hidden_states).unflatten(-1, (self.num_v_heads, self.head_v_dim))
    beta = self.in_proj_b(hidden_states).sigmoid()
    g = -self.A_log.exp() * F.softplus(self.in_proj_a(hidden_states) + self.dt_bias)
    weights = self.conv1d.weight[:, 0].split([self.key_dim, self.key_dim, self.value_dim])
    core = reference_gdn(q, k, v, g, beta, weights)  # [B, S, H, dv]
    normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
    out = self.norm.weight * normed * F.silu(z)
    return self.out_proj(out.reshape(batch, seq_len, -1))


def as_float64_reference(model):
    """Patch a float64 transformers Qwen3.5 model's float32 parts (see the module doc)."""
    for module in model.modules():
        name = type(module).__name__
        if name in ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"):
            module.forward = types.MethodType(one_plus_weight_norm_float64, module)
        elif name in ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"):
            module.forward = types.MethodType(gdn_forward_float64, module)
        elif name == "Qwen3_5MoeTopKRouter":
            module.forward = types.MethodType(router_float64, module)
    return model


def load_reference(directory, dtype=torch.float64, *, patched=True):
    model = _transformers().AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=dtype,
        attn_implementation="sdpa",
        experts_implementation="eager",
        use_kernels=False,
    )  # (transformers' grouped GEMM has no float64; no hub kernels: from transformers 5.25
    # on, train() re-kernelizes a model loaded with them and drops the float64 forwards
    # patched below, model_cases.py)
    return as_float64_reference(model) if dtype == torch.float64 and patched else model


def _transformers():
    import transformers

    return transformers


#: the Qwen3.5-MoE case: the tied case's layers, 4 experts (top 2) and a shared expert on
#: every layer, the load-balancing loss on
MOE = dict(
    {k: v for k, v in TINY.items() if k != "intermediate_size"},
    **{k: v for k, v in CASES["tied"].items()},
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.05,
)


def write_moe_checkpoint(directory, *, seed=0, **changes):
    torch.manual_seed(seed)
    config = _transformers().Qwen3_5MoeTextConfig(**{**MOE, **changes})
    model = _transformers().Qwen3_5MoeForCausalLM(config)
    randomise(model)
    model.save_pretrained(directory)
    return directory


def router_float64(self, hidden_states):
    """transformers' Qwen3_5MoeTopKRouter (softmax in float32 whatever the dtype) in
    float64: the same formula, top-k weights always renormalised."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    top, indices = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), indices

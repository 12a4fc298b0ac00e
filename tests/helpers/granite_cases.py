"""Tiny Granite 4 hybrid (``granitemoehybrid``, dense) checkpoints written by transformers
and their float64 reference (tests/models/test_granite_hybrid.py, family_cases).

transformers 5.25 computes a Mamba-2 layer's decay, scan and gated norm in float32 even
in a float64 model. The float64 reference is transformers' model with each Mamba-2
layer's forward by transformers' projections, split and order of operations around an
independent core (``F.conv1d`` and the token-by-token recurrence,
:func:`mamba_cases.reference_mamba2`) and its gated norm by the same formula in float64
(the RMSNorms: model_cases). ``test_granite_hybrid`` checks the patched forward against
the unpatched one in float32.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from mamba_cases import reference_mamba2
from model_cases import load_hf_reference

TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, shared_intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    max_position_embeddings=256, initializer_range=0.1, num_local_experts=0,
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
    embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2,
    logits_scaling=2.5,
)  # fmt: skip
CASES = {
    # RoPE, attention and Mamba-2 projection biases, a conv kernel of 3, untied,
    # transformers 5's kind names
    "rope": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                 position_embedding_type="rope",
                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                 attention_bias=True, mamba_proj_bias=True, mamba_d_conv=3,
                 tie_word_embeddings=False),
    # no RoPE ("nope", as Granite-4.0-H), the hub's kind names, tied with a pad token
    "nope": dict(layer_types=["mamba", "attention", "mamba"], position_embedding_type="nope",
                 tie_word_embeddings=True, pad_token_id=0),
}  # fmt: skip


def hf_config(case: str, **changes):
    import transformers

    return transformers.GraniteMoeHybridConfig(**{**TINY, **CASES[case], **changes})


def randomise(model) -> None:
    """Norm weights, biases, decays, skips and time-step biases away from their
    initial values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mamba.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("norm.weight", ".bias", "dt_bias", ".D")):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.0)


def write_checkpoint(directory, case: str, *, seed=0, **changes):
    import transformers

    torch.manual_seed(seed)
    model = transformers.GraniteMoeHybridForCausalLM(hf_config(case, **changes))
    randomise(model)
    model.save_pretrained(directory)
    return directory


def mamba_forward_float64(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """transformers' GraniteMoeHybridMambaLayer.forward in float64 for one document: its
    projection and split, dt = softplus(dt + dt_bias) clamped to time_step_limit,
    A = -exp(A_log); the conv and the scan by :func:`mamba_cases.reference_mamba2`;
    z gates before the grouped RMSNorm; the output projection."""
    assert cache is None and attention_mask is None
    heads, groups, state = self.num_heads, self.n_groups, self.ssm_state_size
    projected = self.in_proj(hidden_states)
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, heads], dim=-1)
    x, b, c = xbc.split([self.intermediate_size, groups * state, groups * state], dim=-1)
    dt = F.softplus(dt + self.dt_bias).clamp(*self.time_step_limit)
    y = reference_mamba2(
        x.unflatten(-1, (heads, self.head_dim)),
        b.unflatten(-1, (groups, state)),
        c.unflatten(-1, (groups, state)),
        dt,
        -torch.exp(self.A_log),
        self.D,
        self.conv1d.weight[:, 0],
        self.conv1d.bias,
    ).flatten(2)  # fmt: skip  [B, S, H P]
    h = (y * F.silu(gate)).unflatten(-1, (groups, -1))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
    return self.out_proj(self.norm.weight * h.flatten(-2))


def load_reference(directory, dtype=torch.float64, *, patched=True):
    """transformers' model of ``directory`` (model_cases.load_hf_reference: SDPA, float64
    RMSNorms), its Mamba-2 layers in float64 (:func:`mamba_forward_float64`)."""
    model = load_hf_reference(directory, dtype)
    if dtype == torch.float64 and patched:
        for module in model.modules():
            if type(module).__name__ == "GraniteMoeHybridMambaLayer":
                module.forward = types.MethodType(mamba_forward_float64, module)
    return model

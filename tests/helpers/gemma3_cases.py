"""Tiny Gemma 3 text checkpoints written by transformers and its float64 reference
(tests/models/test_gemma3.py, tests/train/test_train_gemma3.py)."""

from __future__ import annotations

import types

import torch
from model_cases import THREE_LAYERS, one_plus_weight_norm_float64

TINY = dict(
    THREE_LAYERS,
    query_pre_attn_scalar=12,
    sliding_window=5,
    rope_theta=1000.0,
    rope_local_base_freq=100.0,
)
CASES = {
    "tied": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
    ),
    # the default pattern (sliding_window_pattern 2: sliding, full, sliding)
    "capped": dict(
        sliding_window_pattern=2,
        attention_bias=True,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
}


def hf_text_config(case: str, **changes):
    return _transformers().Gemma3TextConfig(**{**TINY, **CASES[case], **changes})


def randomise(model) -> None:
    """Norm weights and biases away from their initial values (no trivial gradient)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))


def write_checkpoint(directory, case: str, *, seed=0, **changes):
    torch.manual_seed(seed)
    model = _transformers().Gemma3ForCausalLM(hf_text_config(case, **changes))
    randomise(model)
    model.save_pretrained(directory)
    return directory


def load_reference(directory, dtype=torch.float64):
    model = _transformers().AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="sdpa", use_kernels=False
    )  # (no hub kernels: they would drop the float64 forwards on train(), model_cases.py)
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__ == "Gemma3RMSNorm":
                module.forward = types.MethodType(one_plus_weight_norm_float64, module)
    return model


def _transformers():
    import transformers

    return transformers

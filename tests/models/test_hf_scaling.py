"""USP attention under transformers keeps the model's own softmax scale.

transformers passes ``scaling=`` to every attention call (``head_dim**-0.5`` for Llama,
``query_pre_attn_scalar**-0.5`` for Gemma-style models, ...). A plug-in that drops it is
invisible on Llama and wrong everywhere else, so both checks here use a scale far from
``head_dim**-0.5``: the registered function called directly on a stub module against the
eager formula, and a whole HF Llama whose attention layers carry another ``scaling``
against the same model with transformers' eager attention.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from model_cases import hf_config

import usp

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")

SCALE = 0.7  # head_dim 8: the default would be 0.354


def eager_attention(q, k, v, scale, causal=True):
    """q [B, H, S, D], k/v [B, Hkv, S, D] -> [B, S, H, D], written out."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, S, S]
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_registered_function_uses_the_given_scaling():
    import usp.models.hf as usp_hf

    name = usp_hf.register(usp.Plan(None, backend="math"), name="usp-scaling-stub")
    fn = transformers.AttentionInterface()[name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    module = types.SimpleNamespace(is_causal=True)
    out, weights = fn(module, q, k, v, None, dropout=0.0, scaling=SCALE)
    assert weights is None
    expected = eager_attention(q, k, v, SCALE)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    default = eager_attention(q, k, v, 8**-0.5)
    assert (out - default).abs().max() > 1e-2, "the scale matters for these inputs"
    none, _ = fn(module, q, k, v, None, scaling=None)  # no scaling given: the default
    torch.testing.assert_close(none, default, rtol=0, atol=1e-12)


def _with_scaling(model, scale: float):
    layers = [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "q_proj")]
    assert layers, "the HF Llama's attention modules carry `scaling`"
    for layer in layers:
        layer.scaling = scale
    return model


def test_hf_model_with_another_scaling_matches_eager():
    import usp.models.hf as usp_hf

    name = usp_hf.register(usp.Plan(None, backend="math"), name="usp-scaling-model")
    config = hf_config()
    torch.manual_seed(3)
    eager = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    ours = transformers.LlamaForCausalLM._from_config(config, attn_implementation=name)
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        default = ours(ids, use_cache=False).logits
        expected = _with_scaling(eager, SCALE)(ids, use_cache=False).logits
        actual = _with_scaling(ours, SCALE)(ids, use_cache=False).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=2e-5)
    assert (actual - default).abs().max() > 1e-2, "the scale changes the logits"

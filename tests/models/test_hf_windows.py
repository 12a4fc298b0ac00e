"""Sliding windows, attention sinks and MLA through the HF plug-in: transformers' gpt-oss
(sinks in every layer, a sliding layer and a full one), Gemma 3 (a sliding layer and a
full one), DeepSeek-V3 (MLA: v's head size 12, q/k's 24) and Qwen2-MoE (a config window
no layer uses), tiny and in float64, under u2 x r2 on 4 gloo ranks, against the same
model in one process with transformers' own attention (gpt-oss: eager, the others: sdpa): logits, and every
parameter's gradient (the sinks' included) summed over the SP group. Windows of 5 and 6
tokens are shorter than a ring chunk (8 tokens of 32), so the windows are what is
tested, not full causal attention. Tolerance 1e-9 (Gemma 3's norm runs in float64 here:
transformers' runs it in float32), 1e-6 for DeepSeek-V3 (its router runs in float32).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from hybrid_cases import COMMON
from reference import relative_error
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.24")

import usp  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shard_batch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-9
#: DeepSeek-V3 computes its MoE router (and RMSNorm) in float32 in transformers: the
#: router's gradient differs from one process's by ~7e-8 (an attention error is O(1))
TOL_FLOAT32_PARTS = {"deepseek_v3": 1e-6}
SEQ = 32
LAYERS = ["sliding_attention", "full_attention"]
CASES = {
    "gpt_oss": dict(layer_types=LAYERS, sliding_window=5, num_local_experts=4,
                    num_experts_per_tok=2),
    "gemma3_text": dict(layer_types=LAYERS, sliding_window=6),
    # MLA: q/k head size 16 + 8 = 24, v's 12 (the attention call gets v of its own size)
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
    # its config names sliding_window 0 that no layer uses (once refused as "a mask of
    # attention limited to 0 tokens")
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
}  # fmt: skip


def _build(model_type, settings, attn_implementation):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **settings})
    config._attn_implementation = attn_implementation
    config._experts_implementation = "eager"  # torch._grouped_mm has no float64
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().eval()


def _errors(model_type, plan, name):
    """Relative errors of the logits and of the worst parameter gradient."""
    settings = CASES[model_type]
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, COMMON["vocab_size"], (1, SEQ), generator=gen)
    weights = torch.randn(1, SEQ, COMMON["vocab_size"], generator=gen, dtype=torch.float64)
    # transformers' eager softmax is float32 except gpt-oss's (which has no sdpa)
    reference = _build(model_type, settings, "eager" if model_type == "gpt_oss" else "sdpa")
    expected = reference(input_ids=ids, use_cache=False).logits
    (expected * weights).sum().backward()
    model = _build(model_type, settings, name)
    model.load_state_dict(reference.state_dict())
    local = model(**shard_batch(plan, ids).hf_kwargs()).logits  # [1, S/P, V]
    (local * plan.shard(weights)).sum().backward()
    errors = {"logits": relative_error(plan.gather(local.detach()), expected.detach())}
    grads = dict(reference.named_parameters())
    worst = {}
    for pname, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=plan.sp_group)  # as FSDP sums gradients over SP
        worst[pname] = relative_error(grad, grads[pname].grad)
    errors["grads"] = max(worst.values())
    errors["worst"] = max(worst, key=worst.get)
    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    errors["sinks"] = len(sinks)
    return errors


def _gemma_norm_float64(self, x):
    """Gemma 3's RMSNorm in the input's dtype (transformers' runs in float32, whose
    rounding would hide a difference in attention below 1e-7)."""
    output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return output * (1.0 + self.weight)


def run_models(ulysses, ring):
    from transformers.models.gemma3 import modeling_gemma3

    plan = usp.Plan(topology(ulysses, ring))
    name = usp_hf.register(plan, name=f"usp_windows_u{ulysses}r{ring}")
    norm = modeling_gemma3.Gemma3RMSNorm.forward
    modeling_gemma3.Gemma3RMSNorm.forward = _gemma_norm_float64
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {model_type: _errors(model_type, plan, name) for model_type in CASES}
    finally:
        modeling_gemma3.Gemma3RMSNorm.forward = norm


def test_gpt_oss_gemma3_deepseek_v3_equal_transformers_under_u2r2(distributed):
    results = distributed.run(run_models, 2, 2, world_size=4, timeout=300)
    for rank, by_model in enumerate(results):
        assert by_model["gpt_oss"]["sinks"] == 2  # sinks in both layers are exercised
        assert set(by_model) == set(CASES)
        for model_type, errors in by_model.items():
            tol = TOL_FLOAT32_PARTS.get(model_type, TOL)
            assert errors["logits"] <= tol, (rank, model_type, errors)
            assert errors["grads"] <= tol, (rank, model_type, errors)

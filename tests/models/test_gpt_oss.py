"""The gpt-oss family (usp.models.gpt_oss) beyond what test_families.py checks for every
family (float64 logits, loss and gradients against transformers, the aux loss off -- a
window of 6 on layer 0 -- and on -- explicit ``layer_types``, windows of 5 --, in one
process and on 4 gloo ranks: u2 x r2, and u1 x r4 with head chunks, windows and sinks
across ranks; the export loaded by transformers) and test_moe.py for both MoE families
(the load-balancing loss against transformers').

Checked here: the experts (sorted segments in float64, torch's grouped GEMM in float32)
against transformers' own ``GptOssExperts`` loop, forward and backward, the clamps
binding and an expert without tokens; the router against transformers'; the published
config and presets (total and active parameters as OpenAI states them); checkpoints in
transformers' grouped layout; refusals (MXFP4 checkpoints, layer kinds, windows, LoRA on
experts).
"""

from __future__ import annotations

import json

import pytest
import torch
from family_cases import CASES, OSS_LAYER_TYPES
from model_cases import (
    FAMILY_CASES,
    TINY,
    global_batch,
    relative_error,
    sft_labels,
)

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    GptOss,
    Lora,
    LoraError,
    ModelConfigError,
    apply_lora,
    config_from_hf,
    model_counts,
    preset,
    training_flops,
)
from usp.models.gpt_oss_experts import GptOssExperts, GptOssRouter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

OSS = {**TINY, **FAMILY_CASES["gpt_oss"][1]}

#: openai/gpt-oss-20b's config.json (its published keys; the weights are MXFP4)
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny gpt-oss written by transformers, aux loss on, 3 layers of explicit kinds
    (full, sliding, sliding) with window 5 (family_cases)."""
    return CASES["gpt_oss-aux"].write(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss")


# ---------------------------------------------------------------------- the MoE block
def _hf_config(**changes):
    config = transformers.GptOssConfig(**{**OSS, **changes})
    config._experts_implementation = "eager"  # transformers' per-expert loop
    return config


@pytest.mark.parametrize("grouped", [False, None])
def test_experts_equal_transformers(grouped):
    """float64 sorted segments (grouped=False) and float32 grouped GEMM (None, where torch
    has one) against transformers' GptOssExperts loop: outputs and the gradients of the
    input, routing weights and all four expert tensors; expert 3 gets no token; the clamps
    bind (limit 0.5: many gate/up values lie outside)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HFExperts

    dtype = torch.float64 if grouped is False else torch.float32
    config = _hf_config()
    hf = HFExperts(config).to(dtype)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    ours = GptOssExperts(4, 32, 48, 2, config.swiglu_alpha, config.swiglu_limit).to(dtype)
    ours.load_state_dict(hf.state_dict())
    ours.grouped_gemm = grouped
    x = torch.randn(9, 32, dtype=dtype)
    scores = torch.rand(9, 4, dtype=torch.float64)
    scores[:, 3] = -1
    weights, idx = scores.topk(2, dim=-1)
    weights = weights.to(dtype)
    outs, inputs = [], []
    for module in (ours, hf):
        xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = module(xi, idx, wi)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        outs.append(out)
        inputs.append((xi.grad, wi.grad))
    gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
    assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.3  # the clamps bind
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    assert relative_error(outs[0], outs[1]) <= tol
    for a, b in zip(inputs[0], inputs[1]):
        assert relative_error(a, b) <= tol
    for (name, p), q in zip(ours.named_parameters(), hf.parameters()):
        assert relative_error(p.grad, q.grad) <= tol, name
    assert ours.gate_up_proj.grad[3].abs().max() == 0  # no token: no gradient


def test_router_equals_transformers():
    """Logits with bias, top-k of the logits, softmax over those k; the full softmax for
    the statistics; bf16 weights from a float32 softmax."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    hf = GptOssTopKRouter(_hf_config()).double()
    router = GptOssRouter(32, 4, 2).double()
    router.init_weights(0.5)
    hf.load_state_dict(router.state_dict())
    x = torch.randn(11, 32, dtype=torch.float64)
    probs, weights, experts = router(x)
    logits, hf_weights, hf_experts = hf(x)
    assert torch.equal(experts, hf_experts)
    assert relative_error(weights, hf_weights) <= 1e-15
    assert relative_error(probs, torch.softmax(logits, -1)) <= 1e-15
    probs16, weights16, _ = router.to(torch.bfloat16)(x.bfloat16())
    assert probs16.dtype == torch.float32 and weights16.dtype == torch.bfloat16


# ---------------------------------------------------------------------- configs
def test_published_config_and_presets():
    """openai/gpt-oss-20b's config.json without its quantization reads as the preset
    gpt-oss-20b (and as transformers reads it); with it, it is refused with what to do.
    Counts: 20.91B / 116.83B parameters, 3.61B / 5.13B active besides the input embedding
    (OpenAI's figures); the tiny preset's total is its model's."""
    unquantized = {k: v for k, v in PUBLISHED_20B.items() if k != "quantization_config"}
    config = config_from_hf(unquantized)
    ours = preset("gpt-oss-20b")
    for name in ("hidden_size", "num_local_experts", "num_hidden_layers", "sliding_window",
                 "rope_theta", "rope_scaling", "layer_types", "router_aux_loss_coef",
                 "eos_token_id", "pad_token_id", "head_dim", "max_position_embeddings"):  # fmt: skip
        assert getattr(config, name) == getattr(ours, name), name
    hf = transformers.GptOssConfig(**unquantized)
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 150000
    assert config.rope_scaling == {k: v for k, v in hf.rope_parameters.items() if k != "rope_theta"}
    assert config.extra["initial_context_length"] == 4096  # kept, written back
    assert config_from_hf(config.to_hf_dict()) == config
    with pytest.raises(ModelConfigError, match=r"quant_method 'mxfp4'.*Mxfp4Config\(dequantize"):
        config_from_hf(PUBLISHED_20B)
    for name, total, active in (("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)):
        counts, c = model_counts(preset(name)), preset(name)
        assert round(counts.total / 1e9, 2) == total, name
        assert round((counts.active - c.vocab_size * c.hidden_size) / 1e9, 2) == active, name
    tiny = preset("gpt-oss-tiny")
    model = GptOss(tiny)
    counts = model_counts(tiny)
    assert counts.total == sum(p.numel() for p in model.parameters())
    experts = model.decoder_layers[0].mlp.experts
    per_expert = sum(p[0].numel() for p in experts.parameters())
    assert counts.active == counts.total - 2 * (8 - 2) * per_expert
    # FLOPs (MFU): a sliding layer's attention counts the (query, key) pairs it sees
    assert counts.windows == (16, None)
    lengths = [40, 10]
    visible = sum(min(i + 1, 16) for i in range(40)) + 10 * 10 / 2  # sliding layer, 2 docs
    full = (40 * 40 + 10 * 10) / 2  # full layer (n^2 / 2 pairs, as for every family)
    per_pair = 4 * tiny.num_attention_heads * tiny.attention_head_dim * 3  # fwd + bwd
    expected = 6 * counts.matmul * 50 + per_pair * (visible + full)
    assert training_flops(tiny, lengths) == pytest.approx(expected, rel=1e-12)


def test_bare_config_defaults_and_plain_rope_export():
    """A config.json without RoPE keys gets transformers' YaRN (theta 150000); plain RoPE
    (rope_scaling None) exports as an explicit default type, which transformers reads as
    plain RoPE; num_experts is read as num_local_experts."""
    bare = {"model_type": "gpt_oss", **{k: OSS[k] for k in ("vocab_size", "hidden_size",
            "intermediate_size", "num_hidden_layers", "num_attention_heads")}}  # fmt: skip
    config, hf = config_from_hf({**bare, "num_experts": 8}), transformers.GptOssConfig(**bare)
    assert config.num_local_experts == config.num_experts == 8
    assert config.rope_theta == 150000 and config.rope_scaling["factor"] == 32.0
    assert config.layer_types == tuple(hf.layer_types)
    plain = config.replace(rope_scaling=None, rope_theta=5e4)
    written = plain.to_hf_dict()
    assert transformers.GptOssConfig(**written).rope_parameters == {
        "rope_type": "default", "rope_theta": 5e4,
    }  # fmt: skip
    assert config_from_hf(written) == plain
    assert plain.replace(num_hidden_layers=1).layer_types == ("sliding_attention",)
    # no attention biases, tied embeddings: the parameters transformers' model has
    changed = {"attention_bias": False, "tie_word_embeddings": True}
    with torch.device("meta"):
        ours = GptOss(config_from_hf({**bare, **changed}))
        theirs = transformers.GptOssForCausalLM(transformers.GptOssConfig(**bare, **changed))
    assert {n: p.shape for n, p in ours.named_parameters()} == {
        n: p.shape for n, p in theirs.named_parameters()
    }
    assert ours.model.layers[0].self_attn.q_proj.bias is None and ours.lm_head is None


def test_bad_configs_are_refused(tmp_path, checkpoint):
    base = {"architectures": ["GptOssForCausalLM"], **OSS}
    for change, message in (
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok\(5\) must be at most "),
        ({"layer_types": ["sliding_attention", "chunked_attention"]},
         r"\['chunked_attention'\] are not gpt-oss layer kinds"),
        ({"layer_types": ["full_attention"]}, "layer_types names 1 layers"),
        ({"sliding_window": None}, "sliding_window is null"),
        ({"sliding_window": 0}, "sliding_window must be an integer >= 1"),
        ({"swiglu_limit": float("nan")}, "swiglu_limit must be a number >= 0"),
        ({"num_experts": 8}, r"num_experts\(8\) and num_local_experts\(4\) differ"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ):  # fmt: skip
        with pytest.raises(ModelConfigError, match=message):
            config_from_hf({**base, **change})
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    written = json.loads((checkpoint / "config.json").read_text())
    written["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(written))
    with pytest.raises(ModelConfigError, match="usp trains unquantized weights"):
        usp.models.from_pretrained(quantized)


# ---------------------------------------------------------------------- checkpoints, LoRA
def test_checkpoint_keeps_transformers_layout(tmp_path, checkpoint):
    """The grouped expert tensors load and save under transformers' own keys and shapes
    (no per-expert split); a reload is bit-equal."""
    from safetensors import safe_open

    model = usp.models.from_pretrained(checkpoint)
    out = model.save_pretrained(tmp_path / "out")
    with (
        safe_open(str(out / "model.safetensors"), "pt") as saved,
        safe_open(str(checkpoint / "model.safetensors"), "pt") as original,
    ):
        assert set(saved.keys()) == set(original.keys())
        for key in original.keys():  # noqa: SIM118 - not a mapping
            assert torch.equal(saved.get_tensor(key), original.get_tensor(key)), key
    again = usp.models.from_pretrained(out)
    assert all(torch.equal(p, again.get_parameter(n)) for n, p in model.named_parameters())
    assert json.loads((out / "config.json").read_text())["layer_types"] == OSS_LAYER_TYPES


def test_lora_on_experts_is_refused_and_attention_adapters_train():
    model = GptOss(preset("gpt-oss-tiny"))
    with pytest.raises(LoraError, match=r"\['gate_proj', 'up_proj', 'down_proj'\].*experts"):
        apply_lora(model, Lora())
    apply_lora(model, Lora(rank=2, targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and "self_attn" in n for n in trained)
    ids = global_batch(1, 24, seed=45, vocab=256)
    model(ids, labels=sft_labels(ids, [2])).backward()
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trained if "lora_B" in n)

"""The Gemma 3 text family (usp.models.gemma3) against transformers' own
``Gemma3ForCausalLM``, beyond what test_families.py checks for every family (float64
logits, loss and gradients in one process and on 4 gloo ranks, the export: both cases of
gemma3_cases).

Tiny checkpoints written by transformers: 3 layers (sliding, full, sliding), window 5, a
linear RoPE scaling on the full layer and another theta on the sliding ones,
``query_pre_attn_scalar`` away from ``head_dim``, all norm weights random; a second one
untied with attention biases, ``final_logit_softcapping`` and the default layer pattern.
Checked here: the config as transformers reads it (both RoPE forms, a multimodal
config); the levers (MLP tiles of its GeGLU included); LoRA against its merged weights
and its PEFT export; a multimodal checkpoint's language model in both key layouts;
parameter counts against transformers'; every refusal.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from gemma3_cases import (
    CASES,
    TINY,
    hf_text_config,
    load_reference,
    one_plus_weight_norm_float64,
    randomise,
    write_checkpoint,
)
from model_cases import global_batch, grad_errors, relative_error, sft_labels

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    PRESETS,
    Gemma3,
    Gemma3Config,
    Levers,
    Lora,
    ModelConfigError,
    apply_lora,
    config_from_file,
    config_from_hf,
    family_for_hf,
    model_counts,
)
from usp.models.lora_export import merged_state, save_peft_adapter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {case: write_checkpoint(root / case, case, seed=3) for case in CASES}


# ---------------------------------------------------------------------- configs
def test_config_reads_as_transformers_reads_it(checkpoints, tmp_path):
    for case, path in checkpoints.items():
        config = config_from_file(path / "config.json")
        hf = transformers.AutoConfig.from_pretrained(path)
        assert isinstance(config, Gemma3Config) and config.family == "gemma3"
        assert list(config.layer_types) == hf.layer_types, case
        for field in ("sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
                      "tie_word_embeddings", "head_dim", "attention_bias"):  # fmt: skip
            assert getattr(config, field) == getattr(hf, field), (case, field)
        full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
        assert config.rope_theta == full["rope_theta"] == 1000.0
        assert config.rope_local_base_freq == local["rope_theta"] == 100.0
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        assert (config.rope_scaling or {"rope_type": "default"}) == scaling, case
        assert config_from_hf(config.to_hf_dict()) == config
    # transformers 4.x's keys (as the published checkpoints): the same config
    legacy = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        **{k: v for k, v in TINY.items()}, "sliding_window_pattern": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }  # fmt: skip
    tied = config_from_file(checkpoints["tied"] / "config.json")
    assert config_from_hf(legacy) == tied
    written = tied.to_hf_dict()
    assert written["architectures"] == ["Gemma3ForCausalLM"]
    assert written["model_type"] == "gemma3_text"
    # a bare config.json: transformers' defaults (pattern 6, theta 1e6 / 1e4, window 4096)
    bare = {"model_type": "gemma3_text", **{k: TINY[k] for k in ("vocab_size", "hidden_size",
            "intermediate_size", "num_attention_heads")}, "num_hidden_layers": 7}  # fmt: skip
    ours, theirs = config_from_hf(bare), transformers.Gemma3TextConfig(**bare)
    assert list(ours.layer_types) == theirs.layer_types
    for field in ("sliding_window", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "query_pre_attn_scalar", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_base_freq == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    # a multimodal config.json: its text_config (with transformers' defaults)
    multimodal = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "torch_dtype": "bfloat16", "text_config": {**legacy, "model_type": "gemma3_text"},
        "vision_config": {"model_type": "siglip_vision_model"},
    }  # fmt: skip
    del multimodal["text_config"]["architectures"], multimodal["text_config"]["vocab_size"]
    assert family_for_hf(multimodal).name == "gemma3"
    from_multimodal = config_from_hf(multimodal)
    assert from_multimodal == tied.replace(vocab_size=262_208)
    assert from_multimodal.extra["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True is not"),
        ({"hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            r"layer_types must name one of",
        ),  # fmt: skip
        ({"layer_types": ["full_attention"]}, r"for each of the 3 layers"),
        ({"sliding_window": None}, r"sliding_window is null but layer_types has sliding"),
        ({"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar must be a number > 0"),
        ({"final_logit_softcapping": -1.0}, r"final_logit_softcapping must be null or > 0"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                    "full_attention": {"rope_type": "default"},
                }
            },  # fmt: skip
            r"RoPE scaling on sliding_attention layers .* not supported",
        ),
        ({"rope_parameters": {"rope_type": "default"}}, r"one table per layer type"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"'dynamic' is not supported"),
    ],
)
def test_configs_usp_cannot_compute_are_refused(changes, message):
    config = {"architectures": ["Gemma3ForCausalLM"], **TINY, **CASES["tied"], **changes}
    with pytest.raises(ModelConfigError, match=message):
        config_from_hf(config, source="x/config.json")


def test_a_multimodal_config_without_text_config_is_refused():
    with pytest.raises(ModelConfigError, match="without a text_config object"):
        config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"]})


# ---------------------------------------------------------------------- levers, LoRA
def test_levers_give_the_same_numbers(checkpoints):
    """Checkpointing with offload, head chunks, MLP tiles (its GeGLU) and loss chunks
    equal the plain model (float64)."""
    ids = global_batch(1, 24, seed=5)
    labels = sft_labels(ids, [3])
    results = []
    for levers in (
        Levers(),
        Levers(activation_checkpointing="offload", attention_head_chunks=2, mlp_tile_tokens=4,
               loss_chunk_tokens=7),
    ):  # fmt: skip
        model = usp.models.from_pretrained(checkpoints["tied"], dtype=torch.float64)
        levers.apply(model)
        loss = model(ids, labels=labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (levered, levered_grads) = results
    assert relative_error(levered, plain) <= 1e-12
    assert max(grad_errors(levered_grads, plain_grads).values()) <= 1e-12
    assert all(layer.mlp.forward.tile == 4 for layer in model.decoder_layers)


def test_lora_equals_its_merged_weights_and_its_peft_export(checkpoints, tmp_path):
    """Adapters on every projection (GeGLU's too): logits equal the base model with the
    merged weights and transformers' model with the PEFT export; only the adapters
    train."""
    model = usp.models.from_pretrained(checkpoints["capped"], dtype=torch.float64)
    lora = Lora(rank=2, alpha=3.0, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"))  # fmt: skip
    apply_lora(model, lora, seed=1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # B starts at 0: make the adapters matter
                param.copy_(0.1 * torch.randn_like(param))
    ids = global_batch(1, 16, seed=6)
    merged = usp.models.from_pretrained(checkpoints["capped"], dtype=torch.float64)
    merged.load_state_dict(merged_state(model.state_dict(), lora))
    with torch.no_grad():
        ours = model(ids)
        assert relative_error(ours, merged(ids)) <= 1e-12
    model(ids, labels=sft_labels(ids, [2])).backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 7 * 3
    peft = pytest.importorskip("peft", reason="the export's reference is PEFT")
    out = save_peft_adapter(
        tmp_path / "adapter", model.state_dict(), lora, base_model=checkpoints["capped"]
    )
    loaded = peft.PeftModel.from_pretrained(load_reference(checkpoints["capped"]), out)
    with torch.no_grad():
        assert relative_error(ours, loaded(ids, use_cache=False).logits) <= 1e-12


# ---------------------------------------------------------------------- checkpoints
def _multimodal(directory):
    """A tiny Gemma3ForConditionalGeneration (SigLIP tower of one layer) saved by
    transformers: its language model is the 'tied' case's shape."""
    text = hf_text_config("tied").to_dict()
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(4)
    model = transformers.Gemma3ForConditionalGeneration(config)
    randomise(model)
    model.save_pretrained(directory)


def test_a_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """The published layout (language_model.model.*, as transformers also writes it)
    and transformers 5's module names (model.language_model.*): usp's logits equal the multimodal model's on text; the
    vision tower is not read; the export is a Gemma3ForCausalLM."""
    from safetensors.torch import load_file, save_file

    _multimodal(tmp_path / "mm")
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "mm", dtype=torch.float64, attn_implementation="sdpa"
    )
    for module in hf.modules():
        if type(module).__name__ == "Gemma3RMSNorm":
            module.forward = types.MethodType(one_plus_weight_norm_float64, module)
    ids = global_batch(1, 12, seed=8)
    with torch.no_grad():
        expected = hf(input_ids=ids, use_cache=False).logits
    state = load_file(tmp_path / "mm" / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in state)  # as published
    in_memory = tmp_path / "in_memory"  # the module names of transformers 5's model
    in_memory.mkdir()
    (in_memory / "config.json").write_text((tmp_path / "mm" / "config.json").read_text())
    renamed = {
        k.replace("language_model.model.", "model.language_model.")
        .replace("vision_tower.", "model.vision_tower.")
        .replace("multi_modal_projector.", "model.multi_modal_projector."): v
        for k, v in state.items()
    }
    assert any(k.startswith("model.vision_tower.") for k in renamed)
    save_file(renamed, in_memory / "model.safetensors")
    for directory in (tmp_path / "mm", in_memory):
        model = usp.models.from_pretrained(directory, dtype=torch.float64)
        assert isinstance(model, Gemma3)
        with torch.no_grad():
            assert relative_error(model(ids), expected) <= 1e-12, directory.name
    written = json.loads((model.save_pretrained(tmp_path / "text") / "config.json").read_text())
    assert written["architectures"] == ["Gemma3ForCausalLM"] and "text_config" not in written


def test_random_init_as_transformers():
    """Norm weights 0 (Gemma's norms multiply by 1 + weight), the pad token's embedding
    row 0, the rest normal(0, initializer_range)."""
    generator = torch.Generator().manual_seed(0)
    model = Gemma3(PRESETS["gemma3-tiny"].replace(initializer_range=0.5))
    model.init_weights(generator)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 3 * 6 + 1 and all(not p.any() for p in norms)
    embed = model.model.embed_tokens.weight
    assert model.model.embed_tokens.padding_idx == 0 and not embed[0].any()
    assert 0.45 <= embed[1:].std().item() <= 0.55


def test_other_depths_keep_the_layer_kinds_in_order():
    """The planner's shallower copies (config.replace(num_hidden_layers=k))."""
    s, f = "sliding_attention", "full_attention"
    assert PRESETS["gemma-3-4b"].replace(num_hidden_layers=7).layer_types == (s,) * 5 + (f, s)
    assert PRESETS["gemma3-tiny"].replace(num_hidden_layers=4).layer_types == (s, s, f, s)
    kinds = PRESETS["gemma3-tiny"].replace(num_hidden_layers=2, layer_types=(f, f))
    assert kinds.layer_types == (f, f)


def test_parameter_counts_equal_transformers():
    """Every preset's count against transformers' own model of its config (meta)."""
    for name in ("gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gemma3-tiny"):
        config = PRESETS[name]
        hf_config = transformers.Gemma3TextConfig(**{
            k: v for k, v in config.to_hf_dict().items() if k not in ("architectures",)
        })  # fmt: skip
        with torch.device("meta"):
            hf = transformers.Gemma3ForCausalLM(hf_config)
        assert model_counts(config).total == sum(p.numel() for p in hf.parameters()), name
    assert round(model_counts(PRESETS["gemma-3-27b"]).total / 1e9, 1) == 27.0

"""The Qwen3.5 text family (usp.models.qwen3_5) against transformers' own
``Qwen3_5ForCausalLM``, beyond what test_families.py checks for every family (float64
logits, loss and gradients in one process and on 4 gloo ranks -- ulysses 2 x ring 2
zigzag, ulysses 1 x ring 4 contiguous, the MoE case on ulysses 4 x ring 1 --, the
export: the cases of qwen3_5_cases).

Tiny checkpoints written by transformers (qwen3_5_cases): 3 layers (GDN, gated full
attention, GDN), 2 key / 4 value GDN heads, partial RoPE (half, a quarter), tied with a
pad token, or untied with attention biases, a conv kernel of 3 and the default layer
pattern. Checked here: the config as transformers reads it (both RoPE forms, a
multimodal config); the float64 reference (transformers' model with its float32
internals in float64) against the unpatched model in float32; the levers; a multimodal
checkpoint's language model in both key layouts (vision tower and mtp.* not read);
parameter counts and FLOPs against transformers'; refusals.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from model_cases import global_batch, grad_errors, relative_error, sft_labels
from qwen3_5_cases import (
    CASES,
    MOE,
    TINY,
    as_float64_reference,
    hf_text_config,
    load_reference,
    randomise,
    write_checkpoint,
    write_moe_checkpoint,
)
from usp_cases import heads_check_plan

transformers = pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    PRESETS,
    Levers,
    ModelConfigError,
    Qwen3_5,
    Qwen3_5Config,
    config_from_file,
    config_from_hf,
    family_for_hf,
    model_counts,
)
from usp.models.gated_deltanet import check_linear_heads  # noqa: E402
from usp.process_groups import HeadLayoutError  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    written = {case: write_checkpoint(root / case, case, seed=3) for case in CASES}
    return {**written, "moe": write_moe_checkpoint(root / "moe", seed=3)}


# ---------------------------------------------------------------------- configs
def test_config_reads_as_transformers_reads_it(checkpoints):
    for case, path in checkpoints.items():
        config = config_from_file(path / "config.json")
        hf = transformers.AutoConfig.from_pretrained(path)
        assert isinstance(config, Qwen3_5Config)
        assert config.family == ("qwen3_5_moe" if case == "moe" else "qwen3_5")
        assert list(config.layer_types) == hf.layer_types, case
        for field in ("tie_word_embeddings", "head_dim", "attention_bias", "pad_token_id",
                      "linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                      "linear_key_head_dim", "linear_value_head_dim"):  # fmt: skip
            assert getattr(config, field) == getattr(hf, field), (case, field)
        assert config.rope_theta == hf.rope_parameters["rope_theta"]
        assert config.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
        assert config_from_hf(config.to_hf_dict()) == config
    moe = config_from_file(checkpoints["moe"] / "config.json")
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                  "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"):  # fmt: skip
        assert getattr(moe, field) == MOE[field], field
    assert "intermediate_size" not in moe.to_hf_dict()  # not a Qwen3.5-MoE key
    tied = config_from_file(checkpoints["tied"] / "config.json")
    assert tied.rotary_dim == 4 and tied.rope_theta == 1000.0
    # transformers 4.x-style keys and an mrope table: the same config, mrope kept
    legacy = {
        "architectures": ["Qwen3_5ForCausalLM"], **TINY, **CASES["tied"], "rope_theta": 1000.0,
        "partial_rotary_factor": 0.5, "rope_parameters": None,
        "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 0],
                         "mrope_interleaved": True},
    }  # fmt: skip
    read = config_from_hf(legacy)
    assert read == tied.replace(mrope={"mrope_section": [1, 1, 0], "mrope_interleaved": True})
    written = read.to_hf_dict()
    assert written["rope_parameters"]["mrope_section"] == [1, 1, 0]
    assert transformers.Qwen3_5TextConfig(**written).rope_parameters["partial_rotary_factor"] == 0.5
    # a bare config.json: transformers' defaults (every 4th layer full, 0.25 rotated)
    bare = {"model_type": "qwen3_5_text", **{k: TINY[k] for k in ("vocab_size", "hidden_size",
            "intermediate_size", "num_attention_heads")}, "num_hidden_layers": 6}  # fmt: skip
    ours, theirs = config_from_hf(bare), transformers.Qwen3_5TextConfig(**bare)
    assert list(ours.layer_types) == theirs.layer_types
    for field in ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                  "tie_word_embeddings", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"]
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    # a multimodal config.json: its text_config
    multimodal = {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "torch_dtype": "bfloat16", "text_config": {**legacy, "model_type": "qwen3_5_text"},
        "vision_config": {"model_type": "qwen3_5_vision"},
    }  # fmt: skip
    del multimodal["text_config"]["architectures"], multimodal["text_config"]["vocab_size"]
    assert family_for_hf(multimodal).name == "qwen3_5"
    from_multimodal = config_from_hf(multimodal)
    assert from_multimodal == read.replace(vocab_size=248320)
    assert from_multimodal.extra["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"layer_types": ["linear_attention", "mamba", "full_attention"]},
         r"layer_types must name one of"),
        ({"layer_types": ["full_attention"]}, r"for each of the 3 layers"),
        ({"linear_num_value_heads": 3}, r"must be a multiple of linear_num_key_heads"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
         r"RoPE scaling .* is not supported for qwen3_5"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}},
         r"partial_rotary_factor\(0.1\) x head_dim\(8\)"),
    ],
)  # fmt: skip
def test_configs_usp_cannot_compute_are_refused(changes, message):
    config = {"architectures": ["Qwen3_5ForCausalLM"], **TINY, **CASES["tied"], **changes}
    with pytest.raises(ModelConfigError, match=message):
        config_from_hf(config, source="x/config.json")


def test_a_multimodal_config_without_text_config_is_refused():
    with pytest.raises(ModelConfigError, match="without a text_config object"):
        config_from_hf({"architectures": ["Qwen3_5ForConditionalGeneration"]})


# ---------------------------------------------------------------------- one process
def test_the_float64_reference_is_transformers_in_float32(checkpoints):
    """The patched float64 reference (qwen3_5_cases) computes transformers' model: its
    logits equal the unpatched model's in float32 within float32's rounding."""
    ids = global_batch(2, 20, seed=9)
    for path in checkpoints.values():
        with torch.no_grad():
            patched = load_reference(path)(ids, use_cache=False).logits
            plain = load_reference(path, torch.float32)(ids, use_cache=False).logits
        assert relative_error(plain.double(), patched) <= 1e-5


def test_levers_give_the_same_numbers(checkpoints):
    """Checkpointing with offload, head chunks, MLP tiles and loss chunks equal the plain
    model (float64)."""
    ids = global_batch(1, 24, seed=5)
    labels = sft_labels(ids, [3])
    results = []
    for levers in (
        Levers(),
        Levers(activation_checkpointing="offload", attention_head_chunks=2, mlp_tile_tokens=7,
               loss_chunk_tokens=7),
    ):  # fmt: skip
        model = usp.models.from_pretrained(checkpoints["biased"], dtype=torch.float64)
        levers.apply(model)
        loss = model(ids, labels=labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (levered, levered_grads) = results
    assert relative_error(levered, plain) <= 1e-12
    assert max(grad_errors(levered_grads, plain_grads).values()) <= 1e-12


# ---------------------------------------------------------------------- heads
def test_gdn_heads_the_ulysses_degree_cannot_split_are_refused():
    """4 GDN value heads over ulysses 8 (what the construction-time check reads of a plan)."""
    plan = heads_check_plan(ulysses=8, sp=8, ranks_per_node=8)
    with pytest.raises(HeadLayoutError, match="4 GDN value heads / 2 key heads cannot be split"):
        check_linear_heads(plan, PRESETS["qwen3.5-tiny"])
    plan.ulysses_degree = 4
    check_linear_heads(plan, PRESETS["qwen3.5-tiny"])  # 4 value heads, keys repeated twice


# ---------------------------------------------------------------------- checkpoints
def _multimodal(directory):
    """A tiny Qwen3_5ForConditionalGeneration (a vision tower of one block) saved by
    transformers, plus an mtp.* tensor as published checkpoints carry: its language model
    is the 'tied' case's shape."""
    from safetensors.torch import load_file, save_file

    text = hf_text_config("tied").to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                  num_position_embeddings=16)  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision,
                                        tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(4)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    randomise(model)
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    state["mtp.fc.weight"] = torch.randn(32, 64)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return model


def test_a_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """transformers 5's layout (model.language_model.*) and the older one
    (language_model.model.*): usp's logits equal the multimodal model's on text; the
    vision tower and mtp.* are not read; the export is a Qwen3_5ForCausalLM."""
    from safetensors.torch import load_file, save_file

    hf = _multimodal(tmp_path / "mm").double()
    as_float64_reference(hf)
    ids = global_batch(1, 12, seed=8)
    with torch.no_grad():
        expected = hf(input_ids=ids, use_cache=False).logits
    state = load_file(tmp_path / "mm" / "model.safetensors")
    assert any(k.startswith("model.language_model.") for k in state)
    assert any(k.startswith("model.visual.") for k in state) and "mtp.fc.weight" in state
    older = tmp_path / "older"
    older.mkdir()
    (older / "config.json").write_text((tmp_path / "mm" / "config.json").read_text())
    renamed = {k.replace("model.language_model.", "language_model.model."): v
               for k, v in state.items()}  # fmt: skip
    save_file(renamed, older / "model.safetensors")
    for directory in (tmp_path / "mm", older):
        model = usp.models.from_pretrained(directory, dtype=torch.float64)
        assert isinstance(model, Qwen3_5)
        with torch.no_grad():
            assert relative_error(model(ids), expected) <= 1e-12, directory.name
    written = json.loads((model.save_pretrained(tmp_path / "text") / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5ForCausalLM"] and "text_config" not in written


def test_random_init_as_transformers():
    """Zero-centred norms 0, gated norms and dt_bias 1, A_log in log(0.01..16), the rest
    normal(0, initializer_range)."""
    generator = torch.Generator().manual_seed(0)
    model = Qwen3_5(PRESETS["qwen3.5-tiny"].replace(initializer_range=0.5))
    model.init_weights(generator)
    params = dict(model.named_parameters())
    gated = [p for n, p in params.items() if n.endswith("linear_attn.norm.weight")]
    zero = [p for n, p in params.items() if n.endswith("norm.weight") and "linear_attn" not in n]
    assert len(gated) == 3 and all((p == 1).all() for p in gated)
    assert len(zero) == 4 * 2 + 2 + 1 and all(not p.any() for p in zero)
    for name, p in params.items():
        if name.endswith("dt_bias"):
            assert (p == 1).all()
        elif name.endswith("A_log"):
            assert (p >= torch.tensor(0.01).log()).all() and (p <= torch.tensor(16.0).log()).all()
        elif name.endswith("conv1d.weight"):
            assert 0.35 <= p.std().item() <= 0.65, name


def test_other_depths_keep_the_layer_kinds_in_order():
    lin, full = "linear_attention", "full_attention"
    assert PRESETS["qwen3.5-9b"].replace(num_hidden_layers=6).layer_types == (
        lin, lin, lin, full, lin, lin,
    )  # fmt: skip
    assert [c.layer_types for c, _ in PRESETS["qwen3.5-9b"].layer_variants()] == [(lin,), (full,)]
    assert [n for _, n in PRESETS["qwen3.5-9b"].layer_variants()] == [24, 8]


def test_parameter_counts_equal_transformers():
    """Every preset's count against transformers' own model of its config (meta)."""
    for name, config_class, model_class in (
        ("qwen3.5-9b", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        ("qwen3.5-tiny", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        ("qwen3.5-35b-a3b", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        ("qwen3.5-moe-tiny", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    ):
        config = PRESETS[name]
        hf_config = getattr(transformers, config_class)(**{
            k: v for k, v in config.to_hf_dict().items() if k not in ("architectures",)
        })  # fmt: skip
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = getattr(transformers, model_class)(hf_config)
        assert model_counts(config).total == sum(p.numel() for p in hf.parameters()), name
    moe = model_counts(PRESETS["qwen3.5-35b-a3b"])
    assert (round(moe.total / 1e9), round(moe.active / 1e9)) == (35, 3)  # the name's sizes
    assert round(model_counts(PRESETS["qwen3.5-9b"]).total / 1e9) == 9


def test_flops_count_attention_on_full_layers_and_the_gdn_recurrence():
    """8 of qwen3.5-9b's 32 layers attend; its 24 GDN layers add C (5 dk + 3 dv) + 6 dk dv
    per token and value head (C = 64, dk = dv = 128: 163,840) in the forward."""
    counts = model_counts(PRESETS["qwen3.5-9b"])
    assert counts.attention_layers == 8
    assert counts.linear_flops_per_token == 24 * 32 * 163_840
    n = 131_072
    expected = 6 * counts.matmul * n + 6 * 8 * 16 * 256 * n * n + 3 * 24 * 32 * 163_840 * n
    assert usp.models.training_flops(PRESETS["qwen3.5-9b"], [n]) == expected
    llama = model_counts(PRESETS["tiny"])
    assert llama.attention_layers is None and llama.linear_flops_per_token == 0

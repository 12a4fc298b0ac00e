"""The Granite 4 hybrid family (usp.models.granite_hybrid) against transformers' own
``GraniteMoeHybridForCausalLM``, beyond what test_families.py checks for every family
(float64 logits, loss and gradients in one process and on 4 gloo ranks -- ulysses 2 x
ring 2 zigzag, ulysses 1 x ring 4 contiguous --, the export: granite_cases' two
checkpoints, RoPE with biases and "nope" tied).

Checked here: the config as transformers reads it (both layer-kind namings, the
``layers_block_type`` alias, transformers' tagged infinity, a bare config.json's defaults);
what usp refuses by name (the MoE form first); the float64 reference against the
unpatched model in float32; parameter counts against transformers' models of the
presets; the initialisation; the Mamba-2 heads check; LoRA's default targets with MLP
tiles (float64, exact).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from granite_cases import CASES, TINY, load_reference, write_checkpoint
from model_cases import global_batch, grad_errors, relative_error, sft_labels
from usp_cases import heads_check_plan

transformers = pytest.importorskip("transformers", minversion="5.25")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    PRESETS,
    GraniteHybrid,
    GraniteHybridConfig,
    Levers,
    Lora,
    ModelConfigError,
    apply_lora,
    config_from_file,
    config_from_hf,
    lora_of,
    model_counts,
)
from usp.models.mamba2 import check_heads  # noqa: E402
from usp.process_groups import HeadLayoutError  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]
ARCH = {"architectures": ["GraniteMoeHybridForCausalLM"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite")
    return {case: write_checkpoint(root / case, case, seed=3) for case in CASES}


def test_config_reads_as_transformers_reads_it(checkpoints):
    for case, path in checkpoints.items():
        config = config_from_file(path / "config.json")
        hf = transformers.AutoConfig.from_pretrained(path)
        assert isinstance(config, GraniteHybridConfig)
        kinds = {"mamba": "linear_attention", "full_attention": "full_attention"}
        assert [kinds[k] for k in config.layer_types] == hf.layer_types, case
        for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                      "logits_scaling", "shared_intermediate_size", "position_embedding_type",
                      "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                      "mamba_d_conv", "mamba_proj_bias", "attention_bias",
                      "tie_word_embeddings", "pad_token_id"):  # fmt: skip
            assert getattr(config, field) == getattr(hf, field), (case, field)
        assert config.time_step_limit == tuple(hf.time_step_limit)
        assert config.rope_theta == hf.rope_parameters["rope_theta"]
        assert config_from_hf(config.to_hf_dict()) == config
    # the hub's form: layers_block_type / "mamba" / "attention", a tagged infinity
    hub = {**ARCH, **TINY, "layers_block_type": ["mamba", "attention", "mamba"],
           "time_step_limit": [0.0, {"__float__": "Infinity"}]}  # fmt: skip
    ours = config_from_hf(hub)
    theirs = transformers.GraniteMoeHybridConfig(
        **{**TINY, "layer_types": ["mamba", "attention", "mamba"]}
    )
    assert ours.layer_types == ("mamba", "full_attention", "mamba")
    assert theirs.layer_types == ["linear_attention", "full_attention", "linear_attention"]
    assert ours.time_step_limit == tuple(theirs.time_step_limit) == (0.0, float("inf"))
    # a bare dense config.json: transformers' defaults (every layer Mamba-2, d_head auto)
    bare = {**ARCH, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 0,
            "mamba_n_heads": 8}  # fmt: skip
    ours, theirs = config_from_hf(bare), transformers.GraniteMoeHybridConfig(**bare)
    assert list(ours.layer_types) == ["mamba", "mamba"] and theirs.layer_types == [
        "linear_attention", "linear_attention"
    ]  # fmt: skip
    for field in ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                  "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
                  "shared_intermediate_size", "embedding_multiplier", "logits_scaling",
                  "position_embedding_type", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_local_experts": 4}, r"num_local_experts=4: usp's granitemoehybrid family "
                                   r"computes the dense form only .*swap_linear_attention"),
        ({"num_local_experts": None}, r"num_local_experts=None"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported"),
        ({"position_embedding_type": "alibi"}, r"position_embedding_type='alibi' .* 'nope'"),
        ({"layer_types": ["mamba", "sliding_attention", "mamba"]}, r"layer_types must name one"),
        ({"mamba_d_head": 8}, r"mamba_n_heads\(4\) x mamba_d_head\(8\) must equal"),
        ({"mamba_n_groups": 3}, r"a multiple of mamba_n_groups\(3\)"),
        ({"logits_scaling": 0}, r"logits_scaling must be a number > 0"),
        ({"time_step_limit": [1.0, 0.5]}, r"time_step_limit must be \[low, high\]"),
    ],
)  # fmt: skip
def test_configs_usp_cannot_compute_are_refused(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        config_from_hf({**ARCH, **TINY, **CASES["nope"], **changes}, source="x/config.json")
    # transformers' default for a config.json without the key is the MoE form
    with pytest.raises(ModelConfigError, match="num_local_experts=8"):
        config_from_hf({k: v for k, v in {**ARCH, **TINY}.items() if k != "num_local_experts"})


def test_the_float64_reference_is_transformers_in_float32(checkpoints):
    """The patched float64 reference (granite_cases) computes transformers' model: its
    logits equal the unpatched model's in float32 within float32's rounding."""
    ids = global_batch(2, 20, seed=9)
    for path in checkpoints.values():
        with torch.no_grad():
            patched = load_reference(path)(ids, use_cache=False).logits
            plain = load_reference(path, torch.float32)(ids, use_cache=False).logits
        assert relative_error(plain.double(), patched) <= 1e-5


def test_parameter_counts_equal_transformers():
    """Every preset's count against transformers' own model of its config (meta)."""
    for name in ("granite4h-tiny", "granite-4.0-h-350m", "granite-4.0-h-micro"):
        written = PRESETS[name].to_hf_dict()
        written["time_step_limit"] = list(PRESETS[name].time_step_limit)
        hf_config = transformers.GraniteMoeHybridConfig(
            **{k: v for k, v in written.items() if k != "architectures"}
        )
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.GraniteMoeHybridForCausalLM(hf_config)
        assert model_counts(PRESETS[name]).total == sum(p.numel() for p in hf.parameters()), name
    assert round(model_counts(PRESETS["granite-4.0-h-micro"]).total / 1e9) == 3  # "3B"
    counts = model_counts(PRESETS["granite-4.0-h-micro"])
    assert counts.attention_layers == 4  # 36 Mamba-2 layers add their scan's FLOPs
    assert counts.linear_flops_per_token == 36 * (2 * 64 * 128 + 64 * (2 * 64 * 64 + 4 * 128 * 64))


def test_random_init_as_transformers():
    """A_log = log(1..H), D, dt_bias and the gated norm 1, conv bias 0, the conv weight
    normal(0, initializer_range)."""
    generator = torch.Generator().manual_seed(0)
    model = GraniteHybrid(PRESETS["granite4h-tiny"].replace(initializer_range=0.5))
    model.init_weights(generator)
    mixers = [layer.mamba for layer in model.decoder_layers if layer.mixer_name == "mamba2"]
    assert len(mixers) == 3
    for mixer in mixers:
        assert torch.equal(mixer.A_log, torch.arange(1, 5, dtype=torch.float32).log())
        for ones in (mixer.D, mixer.dt_bias, mixer.norm.weight):
            assert (ones == 1).all()
        assert not mixer.conv1d.bias.any()
        assert 0.35 <= mixer.conv1d.weight.std().item() <= 0.65


def test_mamba_heads_the_ulysses_degree_cannot_split_are_refused():
    """4 Mamba-2 heads over ulysses 8 (what the construction-time check reads of a plan)."""
    plan = heads_check_plan(ulysses=8, sp=8, ranks_per_node=8)
    with pytest.raises(HeadLayoutError, match="4 Mamba-2 heads / 2 B/C groups cannot be split"):
        check_heads(plan, PRESETS["granite4h-tiny"])
    plan.ulysses_degree = 4
    check_heads(plan, PRESETS["granite4h-tiny"])  # 4 heads, the 2 groups repeated twice


def test_lora_default_targets_and_levers(checkpoints):
    """LoRA's default targets are Granite's attention and fused MLP projections; every
    lever (checkpointing with offload, head chunks, MLP tiles over the fused input_linear:
    its adapter's B split in halves, loss chunks) equals the plain model (float64, loss
    and every adapter's gradient)."""
    ids = global_batch(1, 24, seed=5)
    labels = sft_labels(ids, [3])
    results = []
    for levers in (
        Levers(),
        Levers(activation_checkpointing="offload", attention_head_chunks=2, mlp_tile_tokens=7,
               loss_chunk_tokens=7),
    ):  # fmt: skip
        model = usp.models.from_pretrained(checkpoints["rope"], dtype=torch.float64)
        apply_lora(model, Lora(rank=4, dropout=0.1), seed=3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1),
                                              dtype=p.dtype))  # fmt: skip
        levers.apply(model)
        loss = model(ids, labels=labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    assert set(lora_of(model).targets) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                           "input_linear", "output_linear"}  # fmt: skip
    (plain, plain_grads), (tiled, tiled_grads) = results
    assert len(plain_grads) == 2 * (4 + 2 + 2 + 2)  # A and B: 4 attention, 3 MLPs x 2
    assert relative_error(tiled, plain) <= 1e-12
    assert max(grad_errors(tiled_grads, plain_grads).values()) <= 1e-12


def test_lora_matches_peft_and_its_export_loads(checkpoints, tmp_path):
    """usp's LoRA on attention, the fused MLP and the Mamba-2 input projection against
    PEFT's on transformers' float64 model with the same adapters (copied: usp's layers
    hold the mixer before the MLP, transformers' the MLP first, so the two module orders
    draw A differently): logits, loss and every adapter's gradient at 1e-12; the PEFT
    adapter usp exports, loaded by PeftModel.from_pretrained, gives usp's logits."""
    pytest.importorskip("peft", reason="the reference is PEFT's LoRA")
    from lora_cases import adapter_grads, peft_model, usp_name
    from peft import PeftModel

    from usp.models.lora_export import save_peft_adapter

    ckpt = checkpoints["rope"]
    settings = dict(rank=4, alpha=10.0, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "input_linear", "output_linear", "in_proj"])  # fmt: skip
    ids = global_batch(2, 24, seed=41)
    labels = sft_labels(ids, [4])
    model = usp.models.from_pretrained(ckpt, dtype=torch.float64, backend="math")
    apply_lora(model, Lora(**settings), seed=7)
    reference, _ = peft_model(ckpt, **settings, seed=7, load=load_reference)
    ours = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_" in name:
                mine = ours[usp_name(name)]
                if name.endswith("lora_B.default.weight"):
                    mine.copy_(0.2 * torch.randn(mine.shape, generator=generator, dtype=mine.dtype))
                p.copy_(mine)
    reference.train()
    logits = reference(input_ids=ids, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    want.backward()
    loss = model(ids, labels=labels)
    loss.backward()
    with torch.no_grad():
        assert relative_error(model(ids), logits) <= 1e-12
    assert abs(loss.item() - want.item()) <= 1e-12 * want.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want_grads = adapter_grads(reference)
    assert grads.keys() == want_grads.keys() and len(grads) == 2 * (4 + 3 * 2 + 2)
    assert max(relative_error(grads[n], want_grads[n]) for n in grads) <= 1e-12
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = save_peft_adapter(tmp_path / "adapter", state, model.usp_lora, base_model=ckpt)
    loaded = PeftModel.from_pretrained(load_reference(ckpt), out)
    with torch.no_grad():
        expected = model.eval()(ids)
        assert relative_error(loaded(input_ids=ids, use_cache=False).logits, expected) <= 1e-12

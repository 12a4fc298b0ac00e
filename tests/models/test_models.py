"""usp.models in one process: the config, labels, the chunked loss, HF checkpoints in
and out, the HF attention plug-in, and every error a user can trigger. The native
model is compared with transformers' own LlamaForCausalLM (tests/helpers/model_cases.py):
float64 exact (1e-12), float32 within the issue's tolerances (logits 1e-4 relative,
loss 1e-5, gradients 1e-4 relative). Multi-rank tests: tests/models/test_models_dist.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_cases import (
    IGNORE,
    LLAMA3_ROPE,
    TINY,
    cu_of,
    global_batch,
    grad_errors,
    hf_config,
    hf_reference,
    load_hf_reference,
    relative_error,
    rope_and_dtype,
    sft_labels,
    write_hf_checkpoint,
)
from reference import reference_attention

import usp
from usp.models import (
    PRESETS,
    CheckpointError,
    Levers,
    Llama,
    LlamaConfig,
    ModelConfigError,
    count_labels,
    cross_entropy_sum,
    levers_of,
    shard_batch,
    shift_labels,
    sp_cross_entropy,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "plain": write_hf_checkpoint(root / "plain", seed=1),
        "tied-llama3": write_hf_checkpoint(
            root / "tied", tied=True, rope_scaling=LLAMA3_ROPE, seed=2
        ),
    }


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


# ------------------------------------------------------------------ config
def test_config_reads_both_hf_rope_formats_and_round_trips():
    v5 = hf_config(tied=True, rope_scaling=LLAMA3_ROPE).to_dict()  # rope_parameters
    assert "rope_parameters" in v5
    config = LlamaConfig.from_hf_dict(v5)
    assert config.rope_type == "llama3" and config.rope_theta == TINY["rope_theta"]
    assert config.rope_scaling["original_max_position_embeddings"] == 16
    assert config.tie_word_embeddings and config.attention_head_dim == 8
    v4 = {  # transformers 4.x: rope_theta + rope_scaling with the old "type" key
        **{k: v for k, v in v5.items() if k != "rope_parameters"},
        "rope_theta": TINY["rope_theta"],
        "rope_scaling": {**LLAMA3_ROPE, "type": "llama3"},
    }
    assert LlamaConfig.from_hf_dict(v4) == config
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config
    plain = LlamaConfig.from_hf_dict(hf_config().to_dict())
    assert plain.rope_scaling is None and plain.rope_type == "default"
    no_head_dim = LlamaConfig(**{**TINY, "head_dim": None})
    assert no_head_dim.attention_head_dim == TINY["hidden_size"] // TINY["num_attention_heads"]


DROP = object()  # a key removed from the config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel is not a usp model family"),
        ({"architectures": None, "model_type": "gpt2"}, "model_type 'gpt2' is not a usp model"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported by usp's llama model"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads(3)"),
        ({"vocab_size": DROP}, "missing required key(s) vocab_size"),
    ],
)
def test_config_errors_name_what_is_supported(change, message):
    raw = {**hf_config().to_dict(), "architectures": ["LlamaForCausalLM"], **change}
    raw = {k: v for k, v in raw.items() if v is not DROP}
    with pytest.raises(ModelConfigError) as err:
        usp.models.config_from_hf(raw)  # the family registry, then the family's reader
    assert message in str(err.value)
    if "architectures" in change or "model_type" in change:
        assert "LlamaForCausalLM" in str(err.value) and "usp.models.hf.register" in str(err.value)
        assert "Qwen3ForCausalLM" in str(err.value)  # every family is named


def test_presets():
    tiny = PRESETS["tiny"]
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_hidden_layers) == (256, 64, 2)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (4, 2)
    model = Llama.from_config("tiny")
    assert model.model.embed_tokens.weight.shape == (256, 64)
    with torch.device("meta"):
        big = Llama.from_config("llama3.1-8b")  # shapes only
    assert sum(p.numel() for p in big.parameters()) == 8_030_261_248  # Llama-3.1-8B's count
    with pytest.raises(KeyError, match="unknown llama preset 'llama-9'; known: tiny"):
        Llama.from_config("llama-9")
    with pytest.raises(KeyError, match="unknown llama preset 'qwen3-8b'"):  # another family's
        Llama.from_config("qwen3-8b")


# ------------------------------------------------------------------ labels
def test_shift_labels_dense_packed_and_masked():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert shift_labels(ids).tolist() == [[2, 3, 4, 5, 6, IGNORE]]
    assert shift_labels(ids[0], ignore_index=-1).tolist() == [2, 3, 4, 5, 6, -1]
    cu = cu_of([2, 0, 3, 1])  # an empty document changes nothing
    assert shift_labels(ids, cu_seqlens=cu).tolist() == [[2, IGNORE, 4, 5, IGNORE, IGNORE]]
    prompt_masked = torch.tensor([[IGNORE, IGNORE, 3, 4, 5, 6]])
    assert shift_labels(prompt_masked).tolist() == [[IGNORE, 3, 4, 5, 6, IGNORE]]
    with pytest.raises(ValueError, match="must end at the number of tokens"):
        shift_labels(ids, cu_seqlens=cu_of([2, 3]))
    with pytest.raises(ValueError, match="integer token ids"):
        shift_labels(ids.float())


# ------------------------------------------------------------------ against transformers
@pytest.mark.parametrize("kind", ["plain", "tied-llama3"])
def test_native_matches_transformers_single_process(checkpoints, kind):
    """float64 exact (math backend), float32 within the issue's tolerances; the loss is
    chunked (3 tokens) in float64 and unchunked in float32."""
    ids = global_batch(2, 24, seed=11)
    labels = sft_labels(ids, [5])
    expected = hf_reference(checkpoints[kind], ids, labels)
    for dtype, tol, options, loss_chunk in (
        (torch.float64, (1e-12, 1e-12, 1e-12), {"backend": "math"}, 3),
        (torch.float32, (1e-4, 1e-5, 1e-4), {}, None),
    ):
        model = Llama.from_pretrained(checkpoints[kind], dtype=dtype, **options)
        Levers(loss_chunk_tokens=loss_chunk).apply(model)
        assert all(p.dtype == dtype for p in model.parameters())
        with torch.no_grad():
            logits = model(ids)
        loss = model(ids, labels=labels)
        loss.backward()
        errors = (
            relative_error(logits, expected["logits"]),
            abs(loss.item() - expected["loss"]) / expected["loss"],
            max(grad_errors(_grads(model), expected["grads"]).values()),
        )
        assert all(e <= t for e, t in zip(errors, tol)), (dtype, errors)


def test_packed_single_process_restarts_positions(checkpoints):
    """Packed documents in one process equal running each document alone."""
    cu = cu_of([5, 11, 8])
    ids = global_batch(1, 24, seed=12)
    labels = sft_labels(ids, [0, 3, 1], cu)
    expected = hf_reference(checkpoints["plain"], ids, labels, cu)
    model = Llama.from_pretrained(checkpoints["plain"], dtype=torch.float64, backend="math")
    packed = model.plan.pack(cu)
    with torch.no_grad():
        assert relative_error(model(ids, cu_seqlens=packed), expected["logits"]) <= 1e-12
    loss = model(ids, labels=labels, cu_seqlens=cu)
    loss.backward()
    assert abs(loss.item() - expected["loss"]) <= 1e-12
    assert max(grad_errors(_grads(model), expected["grads"]).values()) <= 1e-12


def test_activation_checkpointing_keeps_gradients(checkpoints):
    ids = global_batch(2, 16, seed=13)
    labels = shift_labels(ids)
    grads = []
    for recompute in (False, True):
        model = Llama.from_pretrained(checkpoints["plain"])
        Levers(activation_checkpointing=recompute).apply(model)
        assert levers_of(model).activation_checkpointing is recompute
        model(ids, labels=labels).backward()
        grads.append(_grads(model))
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


# ------------------------------------------------------------------ the loss
def _loss_inputs(tokens=37, dim=6, vocab=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels[0, ::3] = IGNORE
    return hidden, weight, labels


def test_chunked_loss_equals_unchunked():
    hidden, weight, labels = _loss_inputs()
    expected = torch.nn.functional.cross_entropy(
        (hidden @ weight.T)[0], labels[0], ignore_index=IGNORE
    )
    want = torch.autograd.grad(expected, (hidden, weight))
    for chunk in (None, 1, 5, 24, 1000):
        loss = sp_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
        got = torch.autograd.grad(loss, (hidden, weight))
        assert abs(loss.item() - expected.item()) <= 1e-14, chunk
        assert all(relative_error(g, w) <= 1e-13 for g, w in zip(got, want)), chunk
    with pytest.raises(ValueError, match="positive integer, or None"):
        sp_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="must equal the token shape"):
        sp_cross_entropy(hidden, weight, labels[:, 1:])


def test_loss_without_labels_is_zero_and_still_backpropagates():
    hidden, weight, labels = _loss_inputs()
    labels[:] = IGNORE
    for chunk in (None, 4):
        loss = sp_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
        assert loss.item() == 0.0 and loss.requires_grad
        dh, dw = torch.autograd.grad(loss, (hidden, weight))
        assert torch.equal(dh, torch.zeros_like(hidden)) and torch.equal(
            dw, torch.zeros_like(weight)
        )
    local_sum, count = cross_entropy_sum(hidden, weight, labels)
    assert count == 0 and local_sum.item() == 0.0


def test_num_items_in_batch_normalises_gradient_accumulation(checkpoints):
    """Two micro-batches with num_items_in_batch = their total label count add up to the
    loss (and gradients) of one batch holding both."""
    model = Llama.from_pretrained(checkpoints["plain"], dtype=torch.float64, backend="math")
    ids = global_batch(2, 16, seed=14)
    labels = sft_labels(ids, [7])
    full = model(ids, labels=labels)
    full.backward()
    want = {n: g.clone() for n, g in _grads(model).items()}
    model.zero_grad()
    total = count_labels(labels)
    assert total == int((labels != IGNORE).sum()) == 2 * (16 - 7)  # 6 prompt + the last
    accumulated = sum(
        model(ids[i : i + 1], labels=labels[i : i + 1], num_items_in_batch=total) for i in (0, 1)
    )
    accumulated.backward()
    assert abs(accumulated.item() - full.item()) <= 1e-12
    assert max(relative_error(g, want[n]) for n, g in _grads(model).items()) <= 1e-12
    with pytest.raises(ValueError, match="num_items_in_batch must be >= 0"):
        model(ids, labels=labels, num_items_in_batch=-1)
    minus_one = labels.masked_fill(labels == IGNORE, -1)  # another ignore index
    other = model(ids, labels=minus_one, ignore_index=-1)
    assert abs(other.item() - full.item()) <= 1e-12
    assert count_labels(minus_one, ignore_index=-1) == total


# ------------------------------------------------------------------ checkpoints
def test_sharded_checkpoint_and_dtype(tmp_path):
    directory = write_hf_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    single = write_hf_checkpoint(tmp_path / "single", seed=3)
    a = Llama.from_pretrained(directory)
    b = Llama.from_pretrained(single, dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.float32 for p in a.parameters())  # the checkpoint's dtype
    assert all(p.dtype == torch.bfloat16 for p in b.parameters())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.requires_grad and torch.equal(pa.to(torch.bfloat16), pb), name


def test_save_pretrained_loads_in_transformers(tmp_path):
    config = LlamaConfig(**TINY, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)
    torch.manual_seed(5)
    model = Llama(config)
    path = model.save_pretrained(tmp_path / "ours")
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]
    assert rope_and_dtype(saved)["dtype"] == "float32"
    theirs = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    ids = global_batch(2, 24, seed=15)
    with torch.no_grad():
        assert relative_error(model(ids), theirs(ids, use_cache=False).logits) <= 1e-5
    again = Llama.from_pretrained(path)
    assert again.config == config
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name


def test_checkpoint_errors(tmp_path, checkpoints):
    with pytest.raises(CheckpointError, match="does not exist .* never downloads"):
        Llama.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no config.json in .*found: weights.bin"):
        Llama.from_pretrained(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="is not a directory"):
        Llama.from_pretrained(checkpoints["plain"] / "config.json")

    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(
        json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    with pytest.raises(
        ModelConfigError,
        match="architecture MistralForCausalLM is not a llama model.*usp.models.from_pretrained",
    ):
        Llama.from_pretrained(mistral)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel is not a usp model family"):
        usp.models.from_pretrained(gpt2)

    from safetensors.torch import load_file, save_file

    def variant(name, mutate_state=None, mutate_config=None):
        directory = tmp_path / name
        directory.mkdir()
        state = load_file(checkpoints["plain"] / "model.safetensors")
        config = json.loads((checkpoints["plain"] / "config.json").read_text())
        save_file(mutate_state(state) if mutate_state else state, directory / "model.safetensors")
        (directory / "config.json").write_text(
            json.dumps(mutate_config(config) if mutate_config else config)
        )
        return directory

    def drop_layer_1(state):
        return {k: v for k, v in state.items() if not k.startswith("model.layers.1.")}

    with pytest.raises(
        CheckpointError, match=r"9 parameter\(s\) missing: model.layers.1.input_layernorm.weight"
    ):
        Llama.from_pretrained(variant("missing", drop_layer_1))
    with pytest.raises(CheckpointError, match=r"1 unexpected key\(s\): model.extra.weight"):
        Llama.from_pretrained(
            variant("extra", lambda s: {**s, "model.extra.weight": torch.ones(2)})
        )
    with pytest.raises(CheckpointError, match="shapes differ from config.json: lm_head.weight"):
        Llama.from_pretrained(variant("shape", mutate_config=lambda c: {**c, "vocab_size": 65}))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(
        (checkpoints["plain"] / "config.json").read_text()
    )
    with pytest.raises(
        CheckpointError, match="no model.safetensors or model.safetensors.index.json"
    ):
        Llama.from_pretrained(tmp_path / "noweights")
    with torch.device("meta"):
        shapes_only = Llama(LlamaConfig(**TINY))
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight is on the meta device"):
        shapes_only.save_pretrained(tmp_path / "meta")


# ------------------------------------------------------------------ bad input
def test_forward_input_errors(checkpoints):
    model = Llama.from_pretrained(checkpoints["plain"])
    ids = global_batch(2, 8)
    cases = [
        (
            dict(input_ids=ids, labels=ids[:, :4]),
            "labels shape (2, 4) differs from input_ids shape (2, 8)",
        ),
        (dict(input_ids=ids[0]), "input_ids must be a [B, S/P] tensor"),
        (dict(input_ids=ids.float()), "integer token ids"),
        (dict(input_ids=ids, cu_seqlens=cu_of([8])), "need batch size 1"),
        (dict(input_ids=ids, position_ids=torch.arange(4)), "position_ids shape (4,) must be"),
        (dict(input_ids=ids[:1], cu_seqlens=model.plan.pack(cu_of([4, 5]))), "has 9 tokens"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            model(kwargs.pop("input_ids"), **kwargs)
        assert message in str(err.value), (message, str(err.value))
    with pytest.raises(TypeError, match="usp.process_groups.Topology, a usp.Plan or None"):
        Llama(model.config, "4x2")
    with pytest.raises(TypeError, match="usp.models.LlamaConfig"):
        Llama(TINY)


# ------------------------------------------------------------------ HF plug-in
def test_hf_attention_plugin_single_process(checkpoints):
    """register() in one process: transformers' model with USP attention equals its
    sdpa, and sp_loss / causal_lm_loss equal the plain cross-entropy."""
    import usp.models.hf as usp_hf

    plan = usp.Plan(None, backend="math")
    name = usp_hf.register(plan, name="usp-single")
    assert name == "usp-single" and name in transformers.AttentionInterface()
    ids = global_batch(2, 16, seed=16)
    labels = sft_labels(ids, [3])
    expected = hf_reference(checkpoints["plain"], ids, labels)
    model = load_hf_reference(checkpoints["plain"], attn_implementation=name)
    batch = shard_batch(plan, ids, labels=torch.where(torch.arange(16) < 3, IGNORE, ids))
    assert torch.equal(batch.labels, labels)
    logits = model(**batch.hf_kwargs()).logits
    assert relative_error(logits, expected["logits"]) <= 1e-12
    loss = usp_hf.sp_loss(logits, batch.labels, plan)
    chunked = usp_hf.causal_lm_loss(model, batch, plan, chunk_tokens=4)
    assert abs(loss.item() - expected["loss"]) <= 1e-12
    assert abs(chunked.item() - expected["loss"]) <= 1e-12
    count = int((labels != IGNORE).sum())
    halved = usp_hf.sp_loss(logits, batch.labels, plan, num_items_in_batch=2 * count)
    assert abs(halved.item() - expected["loss"] / 2) <= 1e-12
    other = usp_hf.sp_loss(
        logits, batch.labels.masked_fill(labels == IGNORE, -7), plan, ignore_index=-7
    )
    assert abs(other.item() - expected["loss"]) <= 1e-12
    with pytest.raises(ValueError, match="batch has no labels"):
        usp_hf.causal_lm_loss(model, dataclasses.replace(batch, labels=None), plan)


def test_hf_plugin_errors(checkpoints):
    import usp.models.hf as usp_hf

    for bad in ("sdpa", "eager", "flash_attention_2", ""):
        with pytest.raises(ValueError, match="shadow one of transformers' own"):
            usp_hf.register(None, name=bad)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register("usp-masked", lambda *args, **kwargs: None)
    try:
        with pytest.raises(ValueError, match="has a mask function in transformers"):
            usp_hf.register(None, name="usp-masked")
    finally:
        AttentionMaskInterface._global_mapping.pop("usp-masked")
    fn = transformers.AttentionInterface()[usp_hf.register(None, name="usp-errors")]
    module = torch.nn.Module()
    q = torch.randn(1, 4, 6, 8)  # [B, H, S, D]
    kv = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="does not support a 4-D attention_mask"):
        fn(module, q, kv, kv, torch.zeros(1, 1, 6, 6))
    with pytest.raises(ValueError, match="dropout=0.1"):
        fn(module, q, kv, kv, None, dropout=0.1)
    module.is_causal = False  # a bidirectional sliding window is refused
    with pytest.raises(ValueError, match="causal attention only.*sliding_window=4"):
        fn(module, q, kv, kv, None, sliding_window=4)
    del module.is_causal
    windowed, _ = fn(module, q, kv, kv, None, sliding_window=4, scaling=0.5)  # keys i-3 .. i
    want, _ = reference_attention(
        q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2), causal=True, window=3,
        scale=0.5,
    )  # fmt: skip
    assert relative_error(windowed, want) < 1e-5
    with pytest.raises(ValueError, match="use_cache=False"):
        fn(module, q, torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), None)
    out, weights = fn(module, q, kv, kv, None, scaling=0.5)
    assert out.shape == (1, 6, 4, 8) and weights is None
    with pytest.raises(ValueError, match="labels shape"):
        usp_hf.sp_loss(torch.randn(1, 6, 10), torch.zeros(1, 5, dtype=torch.long), None)


def _public_entries(path):
    """Every public constructor and loader of a native model, as ``f(**keywords)``."""
    from usp.models import family_named

    config = LlamaConfig(**TINY)
    family = family_named("llama")
    return {
        "Llama": lambda **kw: Llama(config, **kw),
        "Llama.from_config": lambda **kw: Llama.from_config(config, **kw),
        "Llama.from_pretrained": lambda **kw: Llama.from_pretrained(path, **kw),
        "usp.models.from_pretrained": lambda **kw: usp.models.from_pretrained(path, **kw),
        "family.build": lambda **kw: family.build(config, **kw),
        "family.from_pretrained": lambda **kw: family.from_pretrained(path, **kw),
        "usp.models.family.build": lambda **kw: usp.models.family.build(config, **kw),
    }


def test_the_renamed_topology_keyword_still_works_with_a_deprecation_warning(checkpoints):
    """``topology=`` (the first release's name of ``plan=``) on every public constructor
    and loader: the same model as ``plan=``, with a DeprecationWarning naming ``plan=``
    that points at the caller; both at once, or a keyword a model does not take (an
    internal function's parameter name among them), is a TypeError naming the public
    function, never one about an internal signature."""
    plan = usp.Plan(None, backend="math")
    ids = global_batch(1, 12, seed=4)
    for name, make in _public_entries(checkpoints["plain"]).items():
        torch.manual_seed(0)
        expected = make(plan=plan)
        torch.manual_seed(0)
        with pytest.warns(
            DeprecationWarning, match=r"\(topology=\.\.\.\) is now .*\(plan=\.\.\.\)"
        ) as seen:
            model = make(topology=plan)
        assert [w.filename for w in seen] == [__file__], (name, [w.filename for w in seen])
        assert model.plan.backend == "math", name
        with torch.no_grad():
            assert torch.equal(model(ids), expected(ids)), name
        with pytest.raises(TypeError, match="give plan= only"):
            make(plan=plan, topology=plan)
        for keyword in ("cls", "topology_or_plan", "verify_calls", "attention_class", "bogus"):
            with pytest.raises(TypeError) as info:
                make(**{keyword: 1})
            message = str(info.value)
            assert "multiple values" not in message and "load_pretrained" not in message, message
            assert "with_options" not in message and "as_plan" not in message, message
            assert repr(keyword) in message and "plan=" in message, (name, message)

"""The model families (usp.models.family: Llama, Qwen2, Qwen3, Mistral) against
transformers' own models, and the family registry.

Each family's tiny checkpoint is written by transformers itself
(tests/helpers/model_cases.py: norm weights away from 1, random biases, Qwen3's head_dim
!= hidden / heads with biases on all four projections, Mistral with a window longer than
the sequence) and read back by usp through the registry. Checked: the config as
transformers reads it (defaults of absent keys included); float64 logits, loss and every
gradient in one process (1e-12: exact up to summation order) and on 4 gloo ranks
(ulysses 2 x ring 2, packed documents, 1e-10; the MoE families with their aux loss in
test_moe.py and test_gpt_oss.py); the export read back by transformers with equal logits;
a sliding window shorter than a document refused, and exact within it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from model_cases import (
    FAMILY_CASES,
    cu_of,
    global_batch,
    grad_errors,
    hf_reference,
    load_hf_reference,
    relative_error,
    sft_labels,
    write_family_checkpoint,
)
from usp_cases import topology

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

import usp  # noqa: E402
from usp.models import (  # noqa: E402
    FAMILIES,
    Levers,
    ModelConfigError,
    config_from_file,
    config_from_hf,
    family_for_hf,
    family_named,
)

NAMES = list(FAMILY_CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: write_family_checkpoint(root / name, name, seed=7) for name in NAMES}


def test_every_family_is_registered_once():
    registered = [f.name for f in FAMILIES]  # gemma3: tests/models/test_gemma3.py
    assert len(set(registered)) == len(registered) and set(NAMES) <= set(registered)
    for family in FAMILIES:
        assert family_named(family.name) is family
        for name, config in family.presets.items():
            assert type(config) is family.config_class, name
            assert usp.models.preset(name) is config
    assert len(usp.models.PRESETS) == sum(len(f.presets) for f in FAMILIES)  # unique names


def hf_window(hf_config) -> int | None:
    """The sliding window transformers' model applies for ``hf_config``: its
    ``sliding_window`` when no ``layer_types`` are given or some layer slides."""
    types = getattr(hf_config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return getattr(hf_config, "sliding_window", None)


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_as_transformers_reads_it(checkpoints, name):
    """The checkpoint's config.json through the registry; a config.json without the keys
    that have family defaults reads as transformers' class fills them; the export's
    config.json reads back equal."""
    path = checkpoints[name] / "config.json"
    config = config_from_file(path)
    assert config.family == name and family_for_hf(json.loads(path.read_text())).name == name
    hf = transformers.AutoConfig.from_pretrained(checkpoints[name])
    for field in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(hf, field), field
    assert config.attention_head_dim == getattr(hf, "head_dim", None) or (
        hf.hidden_size // hf.num_attention_heads
    )
    assert config_from_hf(config.to_hf_dict()) == config
    bare = {  # Qwen's default of 32 KV heads needs 32 query heads
        "architectures": hf.architectures,
        "vocab_size": 64,
        "hidden_size": 128,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
    }
    ours, theirs = config_from_hf(bare), type(hf)(**bare)
    for field in ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), (name, field)
    # the window transformers applies to a bare config (Mistral's class assumes 4096)
    assert ours.attention_window == hf_window(theirs), name
    null = {**bare, "sliding_window": None}  # Mistral v0.2 on: an explicit null, no window
    if name != "gpt_oss":  # sliding layers without a window: transformers' mask raises,
        # usp refuses the config (tests/models/test_gpt_oss.py)
        assert config_from_hf(null).attention_window == hf_window(type(hf)(**null)), name
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.attention_head_dim == (getattr(theirs, "head_dim", None) or 128 // 32)


@pytest.mark.parametrize("name", NAMES)
def test_float64_one_process_matches_transformers(checkpoints, name):
    """Dense rows (loss chunked by 5) and packed documents."""
    dense = global_batch(2, 24, seed=21)
    packed, cu_seqlens = dense[:1], cu_of([9, 15])
    for rows, cu, row_labels in (
        (dense, None, sft_labels(dense, [4])),
        (packed, cu_seqlens, sft_labels(packed, [2, 3], cu_seqlens)),
    ):
        expected = hf_reference(checkpoints[name], rows, row_labels, cu)
        model = usp.models.from_pretrained(checkpoints[name], dtype=torch.float64, backend="math")
        assert model.config.family == name
        Levers(loss_chunk_tokens=5).apply(model)
        with torch.no_grad():
            logits = model(rows, cu_seqlens=cu)
        loss = model(rows, labels=row_labels, cu_seqlens=cu)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert relative_error(logits, expected["logits"]) <= 1e-12, name
        assert abs(loss.item() - expected["loss"]) <= 1e-12 * expected["loss"], name
        assert max(grad_errors(grads, expected["grads"]).values()) <= 1e-12, name


def sp_case(ckpt, ids, labels, cu):
    """float64 on ulysses 2 x ring 2 (math backend): gathered logits, the loss (one value
    on every rank) and the gradients summed over the SP group."""
    plan = usp.Plan(topology(2, 2), backend="math")
    model = usp.models.from_pretrained(ckpt, plan, dtype=torch.float64)
    Levers(activation_checkpointing=True, mlp_tile_tokens=3).apply(model)  # 8 local tokens
    batch = usp.models.shard_batch(plan, ids, labels=labels, cu_seqlens=cu, shift=False)
    with torch.no_grad():
        logits = model(batch.input_ids, cu_seqlens=batch.packed)
    loss = model(batch.input_ids, **batch.model_kwargs())
    loss.backward()
    losses = [None] * 4
    dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad.detach().clone()
        dist.all_reduce(grads[n], group=plan.sp_group)
    gathered = plan.gather(logits, packed=batch.packed)  # a collective: on every rank
    if dist.get_rank():
        return None
    return {"logits": gathered, "losses": losses, "grads": grads}


#: the MoE families run on 4 ranks with their aux loss on (a superset of this case:
#: u2 x r2 packed, activation checkpointing) in test_moe.py and test_gpt_oss.py
SP_NAMES = [name for name in NAMES if name not in ("qwen3_moe", "gpt_oss")]


@pytest.mark.parametrize("name", SP_NAMES)
def test_float64_4_ranks_match_transformers(distributed, checkpoints, name):
    cu = cu_of([12, 20])  # multiples of 2r = 4
    ids = global_batch(1, 32, seed=22)
    labels = sft_labels(ids, [3, 5], cu)
    expected = hf_reference(checkpoints[name], ids, labels, cu)
    result = distributed.run(
        sp_case, str(checkpoints[name]), ids, labels, cu, world_size=4, timeout=240
    )[0]
    assert len(set(result["losses"])) == 1, result["losses"]
    assert abs(result["losses"][0] - expected["loss"]) <= 1e-10 * expected["loss"]
    assert relative_error(result["logits"], expected["logits"]) <= 1e-10
    assert max(grad_errors(result["grads"], expected["grads"]).values()) <= 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_with_equal_logits(checkpoints, tmp_path, name):
    model = usp.models.from_pretrained(checkpoints[name])
    with torch.no_grad():
        for p in model.parameters():  # not the checkpoint's values: the export carries them
            p.add_(0.01 * torch.randn_like(p))
    out = model.save_pretrained(tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == list(family_named(name).architectures)[:1]
    hf = load_hf_reference(out, dtype=torch.float32)
    ids = global_batch(2, 16, seed=23)
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids, use_cache=False).logits
    assert relative_error(ours, theirs) <= 1e-5, name


def test_a_sliding_window_shorter_than_a_document_is_refused(tmp_path):
    """Mistral with sliding_window 8: a 16-token sequence is refused with the window and
    what to do; packed documents of at most 8 tokens are exact (against transformers,
    which applies the window)."""
    ckpt = write_family_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    model = usp.models.from_pretrained(ckpt, dtype=torch.float64, backend="math")
    assert model.config.attention_window == 8
    ids = global_batch(1, 16, seed=24)
    with pytest.raises(ModelConfigError, match=r"sequence of 16 tokens is longer than .*"
                       r"sliding_window\(8\).*seq_len <= 8"):  # fmt: skip
        model(ids)
    cu = cu_of([8, 5, 3])
    with pytest.raises(ModelConfigError, match="a document of 9 tokens"):
        model(ids, cu_seqlens=cu_of([9, 7]))
    labels = sft_labels(ids, [0, 0, 0], cu)
    expected = hf_reference(ckpt, ids, labels, cu)
    assert abs(model(ids, labels=labels, cu_seqlens=cu).item() - expected["loss"]) <= 1e-12
    # what refusing avoids: transformers applies the window inside the 16 tokens, so full
    # causal attention (the same weights without a window) differs after token 8
    unwindowed = type(model)(model.config.replace(sliding_window=None), backend="math")
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        windowed = load_hf_reference(ckpt)(ids, use_cache=False).logits
        full = unwindowed.double()(ids)
    assert relative_error(full[:, :8], windowed[:, :8]) <= 1e-12
    assert relative_error(full[:, 8:], windowed[:, 8:]) > 1e-3


def test_qwen_sliding_window_is_read_as_transformers_reads_it():
    base = {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "sliding_window": 16,
    }  # fmt: skip
    assert config_from_hf(base).attention_window is None  # use_sliding_window: false
    on = config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert on.attention_window == 16  # layers 2 and 3 slide
    assert config_from_hf({**base, "use_sliding_window": True}).attention_window is None
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert (
        config_from_hf({**base, "use_sliding_window": True, "layer_types": types}).attention_window
        == 16
    )

"""RoPE context extension in one process: every RoPE type (default, linear, llama3,
yarn) computed as transformers computes it, and a checkpoint's position settings changed
(``LlamaConfig.with_positions`` + ``from_pretrained(config=...)``, what ``[model]
rope_theta / rope_scaling / max_position_embeddings`` do in ``usp train``).

The reference is transformers' own LlamaForCausalLM loaded from our export of the
extended model (so the export's config.json is checked too), in float64 with SDPA and a
float64 RMSNorm (tests/helpers/model_cases.py): logits, loss and every gradient to 1e-12.
Multi-rank: tests/models/test_models_dist.py::test_yarn_checkpoint_float64_4_ranks.
"""

from __future__ import annotations

import json

import pytest
import torch
from model_cases import (
    LLAMA3_ROPE,
    TINY,
    YARN_ROPE,
    global_batch,
    grad_errors,
    hf_config,
    hf_reference,
    relative_error,
    rope_and_dtype,
    sft_labels,
    write_hf_checkpoint,
)

from usp.models import Levers, Llama, LlamaConfig, ModelConfigError
from usp.models.rope import attention_factor, inverse_frequencies

transformers = pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")

#: (checkpoint, position settings): each a context extension a user would configure
EXTENSIONS = {
    "rope_theta": ("plain", {"rope_theta": 80000.0, "max_position_embeddings": 1024}),
    "linear": ("plain", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # no original_max_position_embeddings: measured against the checkpoint's 256
    "yarn": ("plain", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}, "rope_theta": 5e4}),
    "yarn-all-keys": ("plain", {"rope_scaling": YARN_ROPE, "max_position_embeddings": 512}),
    "yarn-attention-factor": (
        "plain",
        {"rope_scaling": {**YARN_ROPE, "attention_factor": 0.9, "truncate": False}},
    ),
    "llama3-larger-factor": ("llama3", {"rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}}),
    "llama3-to-default": ("llama3", {"rope_scaling": {"rope_type": "default"}}),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {
        "plain": write_hf_checkpoint(root / "plain", seed=1),
        "llama3": write_hf_checkpoint(root / "llama3", rope_scaling=LLAMA3_ROPE, seed=2),
    }


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn", "yarn-attention"])
@pytest.mark.parametrize("head_dim, theta", [(8, 10000.0), (128, 500000.0)])
def test_frequencies_and_scaling_equal_transformers(kind, head_dim, theta):
    """The inverse frequencies bit for bit, and YaRN's cos/sin factor exactly."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 3.0},
        "llama3": LLAMA3_ROPE,
        "yarn": {**YARN_ROPE, "mscale": None, "mscale_all_dim": None},
        "yarn-attention": YARN_ROPE,
    }[kind]
    scaling = None if scaling is None else {k: v for k, v in scaling.items() if v is not None}
    hf = hf_config(head_dim=head_dim, rope_theta=theta, rope_scaling=scaling)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[rope_type](hf)
    ours = LlamaConfig.from_hf_dict(hf.to_dict())
    assert ours.rope_type == rope_type
    assert torch.equal(inverse_frequencies(ours), expected)
    assert attention_factor(ours) == factor
    if kind.startswith("yarn"):
        assert factor != 1.0


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_extended_checkpoint_matches_transformers_float64(checkpoints, tmp_path, name):
    kind, settings = EXTENSIONS[name]
    directory = checkpoints[kind]
    original = LlamaConfig.from_json_file(directory / "config.json")
    config = original.with_positions(**settings)
    changes = original.position_changes(config)
    assert {c.split(":")[0] for c in changes} == set(settings)
    model = Llama.from_pretrained(directory, dtype=torch.float64, config=config, backend="math")
    Levers(loss_chunk_tokens=5).apply(model)
    assert model.config == config
    exported = model.save_pretrained(tmp_path / "extended")
    written = json.loads((exported / "config.json").read_text())
    written = {**written, **rope_and_dtype(written)}  # whichever key form was written
    for key, value in settings.items():
        if key == "rope_scaling" and value["rope_type"] == "default":
            assert written["rope_scaling"] is None
        elif key == "rope_scaling":
            assert {k: written[key][k] for k in value} == value
        else:
            assert written[key] == value

    ids = global_batch(2, 40, seed=21)
    labels = sft_labels(ids, [4])
    expected = hf_reference(exported, ids, labels)  # transformers reads our config.json
    with torch.no_grad():
        logits = model(ids)
    loss = model(ids, labels=labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert relative_error(logits, expected["logits"]) <= 1e-12
    assert abs(loss.item() - expected["loss"]) <= 1e-12 * expected["loss"]
    assert max(grad_errors(grads, expected["grads"]).values()) <= 1e-12
    before = Llama.from_pretrained(directory, dtype=torch.float64, backend="math")
    with torch.no_grad():
        assert relative_error(before(ids), logits) > 1e-4, "the settings changed the model"


def test_only_position_settings_may_differ_from_the_checkpoint(checkpoints):
    directory = checkpoints["plain"]
    original = LlamaConfig.from_json_file(directory / "config.json")
    with pytest.raises(ModelConfigError, match="only rope_theta, rope_scaling, "
                       "max_position_embeddings may differ.*num_hidden_layers differ"):  # fmt: skip
        Llama.from_pretrained(directory, config=original.replace(num_hidden_layers=1))
    assert original.position_changes(original) == []
    extended = original.with_positions(rope_scaling={"rope_type": "llama3", **LLAMA3_ROPE})
    assert extended.rope_scaling["original_max_position_embeddings"] == 16  # given: kept
    filled = original.with_positions(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert filled.rope_scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": TINY["max_position_embeddings"],
    }


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported; "
         "supported: default, linear, llama3, yarn"),
        ({"rope_type": "longrope"}, "rope_type 'longrope' is not supported"),
        ({"rope_type": "linear"}, "linear rope_scaling is missing factor"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
          "beta": 3}, "yarn rope_scaling has unknown key(s) beta; it takes factor, "
         "original_max_position_embeddings, attention_factor, beta_fast"),
        ({"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 8},
         "yarn rope_scaling factor must be a number > 0, got 0"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8.5},
         "original_max_position_embeddings must be a positive integer, got 8.5"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
          "truncate": 1}, "truncate must be true or false, got 1"),
        ({"rope_type": "default", "factor": 2.0}, "default rope_scaling has unknown key(s) "
         "factor; it takes no other key"),
    ],
)  # fmt: skip
def test_rope_scaling_errors_name_what_is_valid(scaling, message):
    with pytest.raises(ModelConfigError) as err:
        LlamaConfig(**TINY, rope_scaling=scaling)
    assert message in str(err.value)

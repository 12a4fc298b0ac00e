"""The model shape a training checkpoint records, compared by value with a run's.

``usp_meta.json`` is JSON: a config's tuples (Qwen3.5's ``layer_types``, Qwen3-MoE's
``mlp_only_layers``) come back as lists, and must still count as the same shape (they
did not: every resume of those families was refused). Checked here in one process: every
preset of every family reads back as its own shape; the comparison's cases (sequences,
numbers, booleans, tables, nested configs); a checkpoint of each family's tiny preset is
written, read back against a freshly built config and loaded; another shape is refused
naming each differing field. The 4-rank resumes of every family are in
``tests/train/test_train_resume_families.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from usp.models import FAMILIES, family_of, preset
from usp.train.checkpoint import META_FILE, Checkpointer, TrainState
from usp.train.checkpoint_shape import (
    CheckpointShapeError,
    check_shape,
    model_shape,
    recorded,
    same_value,
    shape_differences,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: every family's tiny preset
TINY = ("tiny", "qwen3-tiny", "gpt-oss-tiny", "gemma3-tiny", "qwen3-moe-tiny", "qwen3.5-tiny",
        "qwen3.5-moe-tiny", "granite4h-tiny")  # fmt: skip
ALL_PRESETS = [name for family in FAMILIES for name in family.presets]


def _read_back(shape: dict) -> dict:
    """The shape as usp_meta.json gives it back."""
    return json.loads(json.dumps({"model": shape}))["model"]


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_every_presets_shape_reads_back_as_its_own(name):
    config = preset(name)
    saved = _read_back(model_shape(config))
    assert shape_differences(saved, model_shape(config)) == []
    assert shape_differences(saved, config.shape()) == [], "also against the config's tuples"
    check_shape(saved, model_shape(preset(name)), path="x")  # a fresh config of it: no error
    assert model_shape(config) == saved, "what is recorded is what JSON gives back"


def test_the_sequence_fields_are_among_those_compared():
    """The fields that were refused: a tuple in the config, a list in the record."""
    assert isinstance(preset("qwen3.5-tiny").shape()["layer_types"], tuple)
    assert isinstance(preset("qwen3.5-moe-tiny").shape()["layer_types"], tuple)
    assert preset("qwen3-moe-tiny").shape()["mlp_only_layers"] == (0,)
    assert _read_back(model_shape(preset("qwen3-moe-tiny")))["mlp_only_layers"] == [0]


@dataclass(frozen=True)
class _Nested:
    sizes: tuple[int, ...]
    scale: float
    note: str = field(default="", compare=False)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ((1, 2), [1, 2], True),
        (("a", "b"), ["a", "b"], True),
        ((), [], True),
        ((1, 2), [1, 2, 3], False),
        ((1, 2), [2, 1], False),
        (2, 2.0, True),
        (0.5, 0.5, True),
        (2, 3, False),
        (True, 1, False),
        (True, 1.0, False),
        (False, 0, False),
        (True, True, True),
        (None, None, True),
        (None, 0, False),
        ("ab", ["a", "b"], False),
        ("2", 2, False),
        ({"a": (1, 2), "b": {"c": 3}}, {"b": {"c": 3.0}, "a": [1, 2]}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ({"a": [1, [2, 3]]}, {"a": (1, (2, 3))}, True),
        (_Nested((1, 2), 0.5, "x"), {"sizes": [1, 2], "scale": 0.5}, True),
        (_Nested((1, 2), 0.5), _Nested((1, 2), 0.5, "other note"), True),
        (_Nested((1, 2), 0.5), {"sizes": [1, 3], "scale": 0.5}, False),
    ],
)
def test_values_compare_by_value(a, b, same):
    assert same_value(a, b) is same
    assert same_value(b, a) is same
    assert same_value(a, json.loads(json.dumps(recorded(a))))


def test_a_value_json_cannot_hold_is_named():
    with pytest.raises(TypeError, match=r"shape field sizes\[1\]: object"):
        recorded((1, object()), "sizes")
    with pytest.raises(TypeError, match="string keys"):
        recorded({1: 2}, "table")


def _write_meta(directory, shape: dict):
    path = directory / "step_000001"
    path.mkdir(parents=True)
    (path / META_FILE).write_text(json.dumps({"step": 1, "world_size": 1, "model": shape}))
    return path


def test_another_shape_is_refused_naming_each_field(tmp_path):
    saved = model_shape(preset("qwen3.5-tiny"))
    path = _write_meta(tmp_path, saved)
    types = ("linear_attention", "full_attention", "full_attention", "linear_attention")
    other = preset("qwen3.5-tiny").replace(layer_types=types, linear_conv_kernel_dim=2)
    with pytest.raises(CheckpointShapeError) as caught:
        Checkpointer(tmp_path, model_config=other).read_meta(path)
    message = str(caught.value)
    assert (
        "layer_types ['linear_attention', 'linear_attention', 'full_attention', "
        "'linear_attention'] (checkpoint) != ['linear_attention', 'full_attention', "
        "'full_attention', 'linear_attention'] (this run)" in message
    ), message
    assert "linear_conv_kernel_dim 4 (checkpoint) != 2 (this run)" in message, message
    assert "Resume with the [model] that wrote it" in message
    moe = model_shape(preset("qwen3-moe-tiny"))
    message = "; ".join(shape_differences({**moe, "mlp_only_layers": [1]}, moe))
    assert message == "mlp_only_layers [1] (checkpoint) != [0] (this run)"
    lacking = {k: v for k, v in moe.items() if k != "num_experts"}
    assert shape_differences(lacking, moe) == ["num_experts (absent) (checkpoint) != 8 (this run)"]
    assert shape_differences({**moe, "extra": 1}, moe) == [
        "extra 1 (checkpoint) != (absent) (this run)"
    ]
    assert shape_differences({**moe, "tie_word_embeddings": 1}, moe) == [
        "tie_word_embeddings 1 (checkpoint) != True (this run)"
    ]


def test_a_record_before_the_family_registry_is_a_llama(tmp_path):
    shape = {k: v for k, v in model_shape(preset("tiny")).items() if k != "family"}
    path = _write_meta(tmp_path, shape)
    Checkpointer(tmp_path, model_config=preset("tiny")).read_meta(path)  # no error
    with pytest.raises(CheckpointShapeError, match="family 'llama' .checkpoint. != 'qwen3'"):
        Checkpointer(tmp_path, model_config=preset("qwen3-tiny")).read_meta(path)


@pytest.mark.parametrize("name", TINY)
def test_a_checkpoint_of_each_tiny_preset_reads_back_and_loads(tmp_path, name):
    """Written with the preset's config, read back and loaded with a config built anew
    (one process: the comparison is the same on every rank)."""
    config = preset(name)
    family = family_of(config)
    torch.manual_seed(1)
    model = family.build(config, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = Checkpointer(tmp_path, model_config=config).save(model, optimizer, TrainState(2, 8))
    recorded_shape = json.loads((path / META_FILE).read_text())["model"]
    assert recorded_shape == model_shape(config) and recorded_shape["family"] == family.name
    torch.manual_seed(2)
    again = family.build(preset(name), None)
    assert any(not torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))
    state = Checkpointer(tmp_path, model_config=preset(name)).load(
        path, again, torch.optim.AdamW(again.parameters(), lr=1e-3)
    )
    assert state == TrainState(2, 8)
    for (key, a), b in zip(again.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), key

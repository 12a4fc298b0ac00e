"""An exported config.json has the keys the installed transformers writes: compared with
transformers' own ``save_pretrained`` of the same Llama config (usp.models.hf_keys)."""

from __future__ import annotations

import json

import pytest
from model_cases import TINY, YARN_ROPE

from usp.models import LlamaConfig, hf_keys

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

transformers = pytest.importorskip("transformers", reason="compares with transformers' output")

FORM_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "dtype", "torch_dtype")


def saved_by_transformers(tmp_path, rope_scaling, dtype) -> dict:
    """config.json as transformers writes it for these hyper-parameters (not from ours)."""
    config = transformers.LlamaConfig(
        **TINY,
        rope_scaling=None if rope_scaling is None else dict(rope_scaling),
        torch_dtype=dtype,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],  # what a model's save_pretrained adds
    )
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("rope_scaling", [None, YARN_ROPE], ids=["plain", "yarn"])
def test_export_keys_are_what_transformers_writes(tmp_path, rope_scaling):
    theirs = saved_by_transformers(tmp_path, rope_scaling, "bfloat16")
    config = LlamaConfig(**TINY, rope_scaling=rope_scaling, bos_token_id=1, eos_token_id=2)
    ours = config.to_hf_dict(dtype="bfloat16")
    assert {k for k in FORM_KEYS if k in ours} == {k for k in FORM_KEYS if k in theirs}, (
        ours,
        theirs,
    )
    for key, value in ours.items():  # every key we write, with transformers' value
        assert theirs.get(key, "(absent)") == value, (key, value, theirs.get(key, "(absent)"))
    # and it reads back as the same model config
    assert LlamaConfig.from_hf_dict(ours) == config


def test_without_transformers_the_form_every_version_reads(monkeypatch):
    real = hf_keys.importlib.util.find_spec
    monkeypatch.setattr(
        hf_keys.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    hf_keys.transformers_key_form.cache_clear()
    try:
        config = LlamaConfig(**TINY, rope_scaling=YARN_ROPE)
        written = config.to_hf_dict(dtype="float32")
        assert written["rope_theta"] == TINY["rope_theta"] and "rope_parameters" not in written
        assert written["rope_scaling"] == YARN_ROPE and written["torch_dtype"] == "float32"
        # a source that named its dtype "dtype" keeps that name
        renamed = {k: v for k, v in written.items() if k != "torch_dtype"}
        source = LlamaConfig.from_hf_dict({**renamed, "dtype": "bfloat16"})
        assert "dtype" in source.to_hf_dict(dtype="float32")
        assert "torch_dtype" not in source.to_hf_dict(dtype="float32")
    finally:
        hf_keys.transformers_key_form.cache_clear()

"""``usp train`` on a tiny Gemma 3 checkpoint written by transformers (sliding window 5,
shorter than a rank's shard; a linear RoPE scaling on the full layer; tied
embeddings; soft-capping and the other settings under SP: tests/models/test_gemma3.py): the step-1 loss of one process equals transformers'
float64 loss on the same tokens (each packed document alone; 1e-5 relative, the trainer
runs float32); ulysses 2 x ring 2 on 4 gloo ranks with activation checkpointing equals
the one-process run step by step; the export loads in transformers with equal logits."""

from __future__ import annotations

import io

import pytest
import torch
from gemma3_cases import load_reference, write_checkpoint
from model_cases import relative_error
from train_cases import (
    _train_on_ranks,
    assert_matches_single,
    base_config,
    transformers_first_loss,
)

import usp
from usp.train.config import train_config_from_dict
from usp.train.trainer import train

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")

TIMEOUT = 300


def test_usp_train_on_gemma3(distributed, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "tied", seed=11, vocab_size=256)
    config = base_config(steps=2, export=True, checkpoint_interval=0)
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    config["train"]["activation_checkpointing"] = True
    single = train(
        train_config_from_dict(config), None, output_dir=tmp_path / "one", stream=io.StringIO()
    )
    expected = transformers_first_loss(config, load=load_reference)
    first = single.metrics[0]["loss"]
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)

    rows = distributed.run(
        _train_on_ranks, config, 2, 2, str(tmp_path / "u2r2"), world_size=4, timeout=TIMEOUT
    )
    assert all(r == rows[0] for r in rows)
    assert_matches_single(rows[0], single.metrics)

    exported = usp.models.from_pretrained(single.export_dir)
    assert exported.config.family == "gemma3"
    hf = load_reference(single.export_dir, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(exported(ids), hf(ids, use_cache=False).logits) <= 1e-5

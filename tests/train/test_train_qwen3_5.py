"""``usp train`` on tiny Qwen3.5 and Qwen3.5-MoE checkpoints written by transformers
(GDN and gated full-attention layers; the MoE one with a shared expert and the
load-balancing loss; the layers under SP: tests/models/test_qwen3_5.py): the step-1 loss
of one process equals transformers' float64 loss on the same tokens (each packed
document alone; 1e-5 relative, the trainer runs float32); ulysses 2 x ring 2 on 4 gloo
ranks with activation checkpointing equals the one-process run step by step (both
models in one launch); the export loads in transformers with equal logits."""

from __future__ import annotations

import io

import pytest
import torch
from model_cases import relative_error
from qwen3_5_cases import load_reference, write_checkpoint, write_moe_checkpoint
from train_cases import (
    _train_on_ranks,
    assert_matches_single,
    base_config,
    transformers_first_loss,
)

import usp
from usp.train.config import train_config_from_dict
from usp.train.trainer import train

pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]

TIMEOUT = 400


def _job(checkpoint) -> dict:
    config = base_config(steps=2, export=True, checkpoint_interval=0)
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    config["train"]["activation_checkpointing"] = True
    return config


def _train_both(configs, outs):
    """Body for every rank: each job on ulysses 2 x ring 2."""
    return [_train_on_ranks(config, 2, 2, out) for config, out in zip(configs, outs)]


def test_usp_train_on_qwen3_5_and_qwen3_5_moe(distributed, tmp_path):
    checkpoints = {
        "qwen3_5": write_checkpoint(tmp_path / "dense", "tied", seed=11, vocab_size=256),
        "qwen3_5_moe": write_moe_checkpoint(tmp_path / "moe", seed=12, vocab_size=256),
    }
    configs, singles = {}, {}
    for family, checkpoint in checkpoints.items():
        configs[family] = _job(checkpoint)
        singles[family] = train(
            train_config_from_dict(configs[family]), None, output_dir=tmp_path / f"{family}-one",
            stream=io.StringIO(),
        )  # fmt: skip
        expected = transformers_first_loss(configs[family], load=load_reference)
        first = singles[family].metrics[0]["loss"]
        assert abs(first - expected) <= 1e-5 * expected, (family, first, expected)

    outs = [str(tmp_path / f"{family}-u2r2") for family in configs]
    per_rank = distributed.run(
        _train_both, list(configs.values()), outs, world_size=4, timeout=TIMEOUT
    )
    assert all(r == per_rank[0] for r in per_rank)
    for rows, (family, single) in zip(per_rank[0], singles.items()):
        assert_matches_single(rows, single.metrics)

        exported = usp.models.from_pretrained(single.export_dir)
        assert exported.config.family == family
        hf = load_reference(single.export_dir, dtype=torch.float32)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            assert relative_error(exported(ids), hf(ids, use_cache=False).logits) <= 1e-5

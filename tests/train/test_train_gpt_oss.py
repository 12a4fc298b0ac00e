"""``usp train`` on a tiny gpt-oss checkpoint written by transformers (window 6 on the
sliding layers, sinks, experts with the clamped SwiGLU), the load-balancing loss on
(``output_router_logits``, ``router_aux_loss_coef`` 0.1).

The step-1 loss of one process equals transformers' float64 loss on the same tokens (per
micro-batch: the cross-entropy sum over the step's label count plus the coefficient
times the micro-batch's load-balancing loss; 1e-5 relative, the trainer runs float32).
Ulysses 1 x ring 4 on 4 gloo ranks (windows reaching across the ranks' shards) equals
the one-process run step by step. The preset ``gpt-oss-tiny`` trains too.
"""

from __future__ import annotations

import io
import math

import pytest
from model_cases import write_family_checkpoint
from train_cases import (
    _train_on_ranks,
    assert_matches_single,
    base_config,
    moe_job,
    transformers_first_loss,
)

from usp.train.config import train_config_from_dict
from usp.train.trainer import train

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")

COEF = 0.1


def test_usp_train_gpt_oss_with_the_aux_loss(distributed, tmp_path):
    checkpoint = write_family_checkpoint(
        tmp_path / "gpt_oss", "gpt_oss", seed=14, vocab_size=256,
        output_router_logits=True, router_aux_loss_coef=COEF,
    )  # fmt: skip
    config = moe_job(checkpoint)
    config["parallel"] = {"ulysses": 1, "ring": 4, "dp": 1}
    single = train(train_config_from_dict(config), None, output_dir=tmp_path / "one",
                   stream=io.StringIO())  # fmt: skip
    first, expected = single.metrics[0]["loss"], transformers_first_loss(config, COEF)
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)
    rows = distributed.run(
        _train_on_ranks, config, 1, 4, str(tmp_path / "u1r4"), world_size=4, timeout=300
    )
    assert all(r == rows[0] for r in rows)
    assert_matches_single(rows[0], single.metrics)


def test_usp_train_the_tiny_preset(tmp_path):
    config = base_config(steps=2, checkpoint_interval=0)
    config["model"] = {"preset": "gpt-oss-tiny"}
    result = train(train_config_from_dict(config), None, output_dir=tmp_path / "tiny",
                   stream=io.StringIO())  # fmt: skip
    losses = [row["loss"] for row in result.metrics]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0]

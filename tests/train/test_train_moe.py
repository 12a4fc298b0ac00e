"""``usp train`` on a tiny Qwen3-MoE checkpoint written by transformers, with the
load-balancing loss on (``output_router_logits``, ``router_aux_loss_coef`` 0.1).

The step-1 loss of one process equals transformers' on the same tokens: per micro-batch
(one packed row of two sequences) the cross-entropy sum over the step's label count plus
the coefficient times the micro-batch's load-balancing loss (its statistics over every
token of the row and both sparse layers), the micro-batches' losses added as usp's
trainer (and transformers' Trainer) add them; 1e-5 relative (the trainer runs float32).
The metrics' ``aux_loss`` column is transformers' load-balancing loss, the mean over the
step's micro-batches. Ulysses 2 x ring 2 and dp 2 x ring 2 on 4 gloo ranks (one launch)
equal the one-process run step by step, ``aux_loss`` included (the router statistics
summed over the SP group; each replica's micro-batch is one of the one-process run's,
and adds its own aux term as that one does). The preset ``qwen3-moe-tiny`` trains too.
"""

from __future__ import annotations

import io
import math

import pytest
from model_cases import write_family_checkpoint
from train_cases import (
    assert_matches_single,
    base_config,
    moe_job,
    transformers_first_loss,
)
from usp_cases import topology

from usp.train.components import build_plan
from usp.train.config import train_config_from_dict
from usp.train.trainer import train

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")

COEF = 0.1


def test_usp_train_qwen3_moe_with_the_aux_loss(distributed, tmp_path):
    checkpoint = write_family_checkpoint(
        tmp_path / "moe", "qwen3_moe", seed=13, vocab_size=256,
        output_router_logits=True, router_aux_loss_coef=COEF,
    )  # fmt: skip
    config = moe_job(checkpoint)
    single = train(train_config_from_dict(config), None, output_dir=tmp_path / "one",
                   stream=io.StringIO())  # fmt: skip
    expected, expected_aux = transformers_first_loss(config, COEF, with_aux=True)
    first = single.metrics[0]
    assert abs(first["loss"] - expected) <= 1e-5 * expected, (first, expected)
    assert abs(first["aux_loss"] - expected_aux) <= 1e-5 * expected_aux, (first, expected_aux)
    results = distributed.run(_grids_on_ranks, config, str(tmp_path), world_size=4, timeout=400)
    for grid in ("u2r2", "dp2r2"):
        rows = [r[grid] for r in results]
        assert all(r == rows[0] for r in rows), grid
        assert_matches_single([r[:3] for r in rows[0]], single.metrics)
        for (step, *_, aux), ref in zip(rows[0], single.metrics):
            assert abs(aux - ref["aux_loss"]) <= 1e-5 * ref["aux_loss"], (grid, step, aux, ref)


def _grids_on_ranks(config, out):
    """Body for every rank: the job on u2 x r2, then on dp2 x r2 (world 4); per grid the
    metrics' (step, loss, grad_norm, aux_loss) rows."""
    results = {}
    for name, (ulysses, ring, dp) in {"u2r2": (2, 2, 1), "dp2r2": (1, 2, 2)}.items():
        grid = {**config, "parallel": {"ulysses": ulysses, "ring": ring, "dp": dp}}
        job = train_config_from_dict(grid)
        plan = build_plan(job, topology(ulysses, ring))
        result = train(job, plan, output_dir=f"{out}/{name}", stream=io.StringIO())
        results[name] = [
            (r["step"], r["loss"], r["grad_norm"], r["aux_loss"]) for r in result.metrics
        ]
    return results


def test_usp_train_the_tiny_preset(tmp_path):
    config = base_config(steps=2, checkpoint_interval=0)
    config["model"] = {"preset": "qwen3-moe-tiny"}
    result = train(train_config_from_dict(config), None, output_dir=tmp_path / "tiny",
                   stream=io.StringIO())  # fmt: skip
    losses = [row["loss"] for row in result.metrics]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0]

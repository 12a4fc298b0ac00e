"""``usp train`` on HF-format checkpoints of every model family (Llama, Qwen2, Qwen3,
Mistral), each written by transformers itself (tests/helpers/model_cases.py).

Checked per family: the step-1 loss of one process equals transformers' own loss on the
same tokens (its model, float64, each packed document run alone; 1e-5 relative: the
trainer runs float32); ulysses 2 x ring 2 on 4 gloo ranks equals the one-process run
step by step (loss and gradient norm, 1e-4 relative); the final HF export loads in
transformers with the same logits as usp's model of it.

Run elsewhere (:data:`SP_ELSEWHERE`): Qwen3-MoE's u2r2 training job is
test_train_moe.py's (the same checkpoint kind with the load-balancing loss on, u2r2 and
dp 2 x ring 2 against one process). Llama's: test_train_dist.py's
``test_fine_tune_a_checkpoint_on_jsonl_and_export`` (a Llama checkpoint from
``[model] path`` with the byte tokenizer, u2r2 against one process, the same comparison).
Qwen2's: its model on u2r2 against transformers in float64 (losses and gradients,
dense and packed) is tests/models/test_families.py's ``qwen2`` case, and the trainer on
u2r2 with biased projections is this file's Qwen3 case (biases on all four). dp 2 x
ring 2 against one process: test_train_moe.py (a Qwen3-MoE checkpoint: Qwen3's attention
with biases and q/k norms) and test_train_dist.py's
``test_dp2_sp2_replicas_read_different_data``.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from model_cases import FAMILY_CASES, load_hf_reference, relative_error, write_family_checkpoint
from train_cases import _train_on_ranks, assert_matches_single, base_config

import usp
from usp.train import components
from usp.train.config import train_config_from_dict
from usp.train.data import IGNORE_INDEX, micro_batch_of
from usp.train.trainer import train

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")

TIMEOUT = 300
#: families whose u2r2 training job against one process other tests cover (docstring)
SP_ELSEWHERE = {
    "qwen3_moe": "test_train_moe.py::test_usp_train_qwen3_moe_with_the_aux_loss",
    "llama": "test_train_dist.py::test_fine_tune_a_checkpoint_on_jsonl_and_export",
    # the model: tests/models/test_families.py's qwen2 case; the trainer: qwen3's here
    "qwen2": "test_families.py::test_float64_4_ranks_match_transformers[qwen2]",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint per family with a byte vocabulary (the synthetic data's)."""
    root = tmp_path_factory.mktemp("family_checkpoints")
    return {
        name: write_family_checkpoint(root / name, name, seed=11, vocab_size=256)
        for name in FAMILY_CASES
    }


def family_job(checkpoint) -> dict:
    config = base_config(steps=2, export=True, checkpoint_interval=0)
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    return config


def transformers_first_loss(config: dict) -> float:
    """transformers' float64 loss of the first global batch the trainer reads: every
    sequence's documents run alone, one sum over all labels / their count."""
    job = train_config_from_dict(config)
    source = components.model_source(job)
    _, dataset = components.build_dataset(job, source, job.data.document_multiple)
    model = load_hf_reference(source.directory)
    total, count = 0.0, 0
    with torch.no_grad():
        for g in range(job.train.global_batch):
            row = micro_batch_of([dataset.sequence(g)])
            bounds = row.cu_seqlens.tolist()
            for a, b in zip(bounds, bounds[1:]):
                logits = model(row.input_ids[:, a:b], use_cache=False).logits[0]
                labels = row.labels[0, a:b]
                total += F.cross_entropy(
                    logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"
                ).item()
                count += int((labels != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_usp_train_on_each_family(distributed, checkpoints, tmp_path, name):
    config = family_job(checkpoints[name])
    job = train_config_from_dict(config)
    single = train(job, None, output_dir=tmp_path / "single", stream=io.StringIO())
    first = single.metrics[0]["loss"]
    expected = transformers_first_loss(config)
    assert abs(first - expected) <= 1e-5 * expected, (name, first, expected)

    if name not in SP_ELSEWHERE:
        rows = distributed.run(
            _train_on_ranks, config, 2, 2, str(tmp_path / "u2r2"), world_size=4, timeout=TIMEOUT
        )
        assert all(r == rows[0] for r in rows)
        assert_matches_single(rows[0], single.metrics)

    exported = usp.models.from_pretrained(single.export_dir)
    assert exported.config.family == name
    hf = load_hf_reference(single.export_dir, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(exported(ids), hf(ids, use_cache=False).logits) <= 1e-5

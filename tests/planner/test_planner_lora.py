"""``usp plan`` with ``[train] lora``: the trainer's own build (usp.train.components with
LoRA applied, fully_shard_model keeping the frozen base in bf16, AdamW over the
adapters) measured under fake tensors, so the footprint counts what LoRA changes.

Checked, byte for byte on one rank of u2 x r2 (a CUDA plan: bf16 compute): the sharded
parameters are the bf16 base plus the float32 adapters, the gradients the adapters'
only, AdamW's state two float32 moments (and a step count) per adapter only; with the
tiled MLP and dropout, representative tiles give the full loops' footprint.
"""

from __future__ import annotations

import math

import pytest
from planner_cases import target_of_job, write_config

from usp.models import PRESETS, Levers, Lora, apply_lora, family_of
from usp.models.norm import NORM_CHUNK_TOKENS
from usp.planner.footprint import Choice
from usp.planner.measure import measure
from usp.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

WORLD = 4


def _shard_elements(p) -> int:
    """Elements of one rank's FSDP2 shard of ``p`` (dim 0 split, padded to the world)."""
    return math.ceil(p.shape[0] / WORLD) * (p[0].numel() if p.dim() > 1 else 1)


def test_lora_footprint_counts_adapters_only(tmp_path):
    job = load_train_config(write_config(tmp_path, gpus=WORLD, seq_len=256, device="cuda"))
    lora = Lora(rank=4, targets=["q_proj", "v_proj", "down_proj"])
    target = target_of_job(
        job.with_train(lora={"rank": 4, "targets": list(lora.targets)}), WORLD, "cuda"
    )
    footprint = measure(target, Choice(2, 2, 1, Levers()))
    full = measure(target_of_job(job, WORLD, "cuda"), Choice(2, 2, 1, Levers()))

    config = PRESETS["tiny"].replace(num_hidden_layers=2)
    model = apply_lora(family_of(config).build(config, None), lora)
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    frozen = [p for n, p in model.named_parameters() if not p.requires_grad]
    assert len(adapters) == 2 * 3 * 2
    adapter_shards = sum(_shard_elements(p) for p in adapters)
    parameters = 2 * sum(_shard_elements(p) for p in frozen) + 4 * adapter_shards
    *_, clip, optimizer = footprint.phases  # (forward 0, backward 0, clip, optimizer)
    assert all(phase.breakdown["parameters"] == parameters for phase in footprint.phases)
    assert clip.breakdown["gradients"] == 4 * adapter_shards  # float32, adapters only
    # two float32 moments per adapter element and a float32 step count per adapter
    assert clip.breakdown["optimizer_state"] == 8 * adapter_shards + 4 * len(adapters)
    assert footprint.peak_device < full.peak_device
    assert full.phases[-2].breakdown["optimizer_state"] > 10 * clip.breakdown["optimizer_state"]


def test_representative_tiles_with_lora_give_the_full_loops_footprint(tmp_path):
    """Dropout masks and the tiled MLP's adapters in tiles: 3.5 RMSNorm tiles and 3.5
    MLP tiles of 4096 tokens per rank, the first and the last of each only."""
    per_rank = 3 * NORM_CHUNK_TOKENS + NORM_CHUNK_TOKENS // 2
    path = write_config(tmp_path, gpus=WORLD, seq_len=WORLD * per_rank, device="cuda")
    job = load_train_config(path).with_train(lora={"rank": 4, "dropout": 0.1})
    target = target_of_job(job, WORLD, "cuda")
    choice = Choice(1, 4, 1, Levers("offload", 4096))
    full = measure(target, choice, representative=False)
    assert measure(target, choice, representative=True) == full
    assert full.peak_host > 0

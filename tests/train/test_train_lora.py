"""``usp train`` with ``[train] lora`` (usp.models.lora), against a hand-written float64
reference loop and across grids.

The reference (:func:`reference_run`) is not the trainer: transformers' float64 model of
the checkpoint with PEFT's LoRA (tests/helpers/lora_cases.py: usp's documented init, the
keyed dropout written with numpy), the data's global batch sequence by sequence and
document by document (each document's tokens at their data-stream indices), one
cross-entropy sum over the global batch / its label count, ``clip_grad_norm_``, AdamW over
the adapters with the schedule written out here. The run under test has dropout 0.1,
activation checkpointing with offload and the tiled MLP, micro-batches of 2 sequences.

Checked: every step's loss and gradient norm against the reference (1e-5 relative;
float32 against float64), step 1 equal to the base model's loss; ulysses 2 x ring 2 and
dp 2 x ring 2 on 4 gloo ranks equal to one process; checkpoints hold only the adapters
and resume exactly; a resume with other LoRA settings is refused; the exported adapter
loaded by ``PeftModel.from_pretrained`` on transformers' base model gives usp's logits and
the merged export the same; on 4 ranks in bf16 the frozen base stays bf16 and bit for bit
unchanged, adapters and their AdamW state float32, the base without gradients.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lora_cases import peft_model
from model_cases import load_hf_reference, relative_error, write_family_checkpoint
from train_cases import _relative, _train_on_ranks, assert_matches_single, base_config
from usp_cases import topology

import usp
from usp.errors import CheckpointError, ConfigError
from usp.train import components
from usp.train.config import train_config_from_dict
from usp.train.data import IGNORE_INDEX, micro_batch_of
from usp.train.trainer import train

pytest.importorskip("transformers", reason="the reference is HF transformers")
pytest.importorskip("peft", reason="the reference is PEFT's LoRA")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TIMEOUT = 300
STEPS = 3
LORA = {"rank": 4, "alpha": 8, "dropout": 0.1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_family_checkpoint(tmp_path_factory.mktemp("lora_base") / "llama", "llama", seed=12, vocab_size=256)  # fmt: skip


def lora_job(checkpoint, **train) -> dict:
    options = {"steps": STEPS, "export": True, "checkpoint_interval": 1, "keep_checkpoints": 3,
               "lora": LORA, "activation_checkpointing": "offload", "mlp_tile_tokens": 8}  # fmt: skip
    config = base_config(**{**options, **train})
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    return config


@pytest.fixture(scope="module")
def single(checkpoint, tmp_path_factory):
    config = lora_job(checkpoint)
    out = tmp_path_factory.mktemp("lora_single")
    result = train(train_config_from_dict(config), None, output_dir=out, stream=io.StringIO())
    return config, result


# ----------------------------------------------------------------------------- the reference
def reference_lr(t, step: int) -> float:
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = t.steps - t.warmup_steps - 1
    progress = 1.0 if span <= 0 else min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def reference_run(config: dict):
    """``(losses, norms, base_first_loss, model)`` of the hand-written loop."""
    job = train_config_from_dict(config)
    t, lora = job.train, job.train.lora
    source = components.model_source(job)
    _, dataset = components.build_dataset(job, source, job.data.document_multiple)
    model, tokens = peft_model(
        source.directory, rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets),
        seed=t.seed, dropout=lora.dropout,
    )  # fmt: skip
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": adapters, "weight_decay": t.weight_decay}],  # all matrices
        lr=t.lr, betas=tuple(t.adam_betas), eps=t.adam_eps,
    )  # fmt: skip
    losses, norms, base_first = [], [], None
    for step in range(t.steps):
        terms, count = [], 0
        for g in range(step * t.global_batch, (step + 1) * t.global_batch):
            row = micro_batch_of([dataset.sequence(g)])  # one sequence
            bounds = row.cu_seqlens.tolist()
            for a, b in zip(bounds, bounds[1:]):  # each document alone
                tokens.indices = np.arange(g * t.seq_len + a, g * t.seq_len + b)
                ids, labels = row.input_ids[:, a:b], row.labels[0, a:b]
                if step == 0:
                    with torch.no_grad(), model.disable_adapter():
                        logits = model(input_ids=ids, use_cache=False).logits[0]
                        base_first = (base_first or 0.0) + F.cross_entropy(
                            logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"
                        ).item()  # fmt: skip
                logits = model(input_ids=ids, use_cache=False).logits[0]
                terms.append(
                    F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
                )
                count += int((labels != IGNORE_INDEX).sum())
        loss = torch.stack(terms).sum() / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(adapters, t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(t, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(float(norm))
        if step == 0:
            base_first /= count
    return losses, norms, base_first, model


def test_one_process_matches_the_peft_reference_loop(single):
    config, result = single
    losses, norms, base_first, _ = reference_run(config)
    rows = result.metrics
    assert len(rows) == STEPS
    assert abs(rows[0]["loss"] - base_first) <= 1e-5 * base_first, "step 1 is the base model's"
    assert losses[0] == pytest.approx(base_first, rel=1e-12), "B = 0 in the reference too"
    for step, (row, loss, norm) in enumerate(zip(rows, losses, norms)):
        assert _relative(row["loss"], loss) <= 1e-5, (step, row["loss"], loss)
        assert _relative(row["grad_norm"], norm) <= 1e-5, (step, row["grad_norm"], norm)
    assert norms[0] > 0.5 and losses[-1] < losses[0], "clipping active; the adapters learn"


def test_4_ranks_equal_one_process(single, distributed, tmp_path):
    """u2 x r2 (zigzag, from the checkpoint via the meta device and rank 0's broadcast)
    and dp 2 x r2: the same losses and norms; the masks follow the tokens."""
    config, result = single
    for ulysses, ring, parallel in [(2, 2, None), (1, 2, {"ulysses": 1, "ring": 2, "dp": 2})]:
        run = dict(config, parallel=parallel) if parallel else config
        rows = distributed.run(
            _train_on_ranks, run, ulysses, ring, str(tmp_path / f"u{ulysses}r{ring}"),
            world_size=4, timeout=TIMEOUT,
        )  # fmt: skip
        assert all(r == rows[0] for r in rows)
        assert_matches_single(rows[0], result.metrics)


def test_checkpoints_hold_the_adapters_and_resume_exactly(single, tmp_path):
    import torch.distributed.checkpoint as dcp

    config, result = single
    keys = dcp.FileSystemReader(str(result.checkpoint)).read_metadata().state_dict_metadata
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys), model_keys
    job = train_config_from_dict(config)
    out = tmp_path / "resumed"
    first = train(job, None, output_dir=out, stop_after=2, stream=io.StringIO()).metrics
    numbers = [(r["loss"], r["grad_norm"]) for r in first]
    assert numbers == [(r["loss"], r["grad_norm"]) for r in result.metrics[:2]]
    resumed = train(job, None, output_dir=out, resume=True, stream=io.StringIO())
    assert [r["step"] for r in resumed.metrics] == [3]
    for key in ("loss", "grad_norm"):
        assert resumed.metrics[0][key] == result.metrics[2][key], key
    other = train_config_from_dict(lora_job(config["model"]["path"], lora={**LORA, "rank": 8}))
    with pytest.raises((CheckpointError, ConfigError), match="lora"):
        train(other, None, output_dir=out, resume=True, stream=io.StringIO())


def test_the_exports_give_the_trained_model(single, checkpoint):
    """adapter/ through PEFT on transformers' base model = hf/ (merged) in transformers =
    usp's model of hf/ (float32), and close to the float64 reference after 3 steps."""
    from peft import PeftModel
    from safetensors import safe_open

    config, result = single
    written = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["lora_dropout"]) == (4, 8.0, 0.1)
    assert written["base_model_name_or_path"] == str(checkpoint.resolve())
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert len(names) == 2 * 7 * 2 and all(
            f.get_tensor(n).dtype == torch.float32 for n in names
        )
    peft_loaded = PeftModel.from_pretrained(
        load_hf_reference(checkpoint, dtype=torch.float32), result.adapter_dir
    ).eval()
    merged_hf = load_hf_reference(result.export_dir, dtype=torch.float32)
    ours = usp.models.from_pretrained(result.export_dir)
    _, _, _, reference = reference_run(config)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        via_peft = peft_loaded(input_ids=ids, use_cache=False).logits
        base = load_hf_reference(checkpoint, dtype=torch.float32)(input_ids=ids).logits
        assert relative_error(via_peft, base) > 1e-3, "the adapters changed the model"
        assert relative_error(merged_hf(input_ids=ids, use_cache=False).logits, via_peft) <= 1e-5
        assert relative_error(ours(ids), via_peft) <= 1e-5
        reference.eval()
        assert relative_error(reference(input_ids=ids, use_cache=False).logits, via_peft) <= 1e-4


# ----------------------------------------------------------------------------- dtypes
def _bf16_steps(config):
    """Two of the trainer's steps (its own build: usp.train.components, fully_shard_model,
    TrainStep) in bf16 on u2 x r2; what the parameters and the optimizer hold after."""
    from usp.train.parallelize import fully_shard_model
    from usp.train.step import TrainStep

    job = train_config_from_dict(config)
    plan = components.build_plan(job, topology(2, 2))
    source = components.model_source(job)
    levers = job.train.levers
    model = components.build_model(job, source, plan, levers)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    sharded = fully_shard_model(
        model, plan.topology, levers=levers, compute_dtype=torch.bfloat16
    ).module
    optimizer = components.build_optimizer(job, sharded, levers)
    step = TrainStep(sharded, optimizer, grad_clip=job.train.grad_clip)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    batch = usp.models.shard_batch(
        plan, ids, cu_seqlens=torch.tensor([0, 24, 64], dtype=torch.int32)
    )
    for _ in range(2):
        step.run([batch], int((batch.labels != IGNORE_INDEX).sum()) * 4)  # (any count)
    state = {"dtypes": {}, "unchanged": [], "grads": [], "moved": 0.0}
    for name, p in sharded.named_parameters():
        state["dtypes"][name] = (p.dtype, type(p).__name__, p.requires_grad)
        full = p.full_tensor()
        if name in frozen:
            state["unchanged"].append(torch.equal(full, frozen[name].to(torch.bfloat16)))
            state["grads"].append(p.grad)
        elif name.endswith("lora_B"):
            state["moved"] = max(state["moved"], float(full.abs().max()))
    state["optimizer"] = sorted(
        {(v.dtype, k) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
    )
    state["optimizer_params"] = len(optimizer.state)
    return state if dist.get_rank() == 0 else None


def test_bf16_base_stays_frozen_and_bit_identical(distributed):
    config = base_config(dtype="bfloat16", lora={"rank": 4, "targets": ["q_proj", "down_proj"]})
    state = distributed.run(_bf16_steps, config, world_size=4, timeout=TIMEOUT)[0]
    frozen = {n: v for n, v in state["dtypes"].items() if not v[2]}
    adapters = {n: v for n, v in state["dtypes"].items() if v[2]}
    assert len(adapters) == 2 * 2 * 2 and all(n.endswith(("lora_A", "lora_B")) for n in adapters)
    assert all(v == (torch.bfloat16, "DTensor", False) for v in frozen.values()), frozen
    assert all(v == (torch.float32, "DTensor", True) for v in adapters.values()), adapters
    assert all(state["unchanged"]) and len(state["unchanged"]) == len(frozen), "bit for bit"
    assert all(g is None for g in state["grads"]), "the base gets no gradient"
    assert state["moved"] > 0, "the adapters trained"
    assert state["optimizer_params"] == len(adapters)
    assert state["optimizer"] == [(torch.float32, "exp_avg"), (torch.float32, "exp_avg_sq")]


def test_config_errors_name_the_key(checkpoint):
    for bad, message in [
        ({"rank": 0}, r"\[train\] lora.rank must be an integer >= 1, got 0"),
        ({"rnak": 4}, r"\[train\] lora: unknown key 'rnak'; expected one of rank, alpha"),
        ("yes", r"\[train\] lora must be a table"),
    ]:
        with pytest.raises(ConfigError, match=message):
            train_config_from_dict(lora_job(checkpoint, lora=bad))
    job = train_config_from_dict(lora_job(checkpoint, lora={"targets": ["q_proj", "w_proj"]}))
    with pytest.raises(ConfigError, match=r"\[train\] lora: targets \['w_proj'\] name no Linear"):
        components.build_model(job, components.model_source(job), components.build_plan(job, None))
    assert train_config_from_dict(lora_job(checkpoint, lora=True)).train.lora.rank == 16
    assert train_config_from_dict(lora_job(checkpoint, lora=False)).train.lora is None

"""The trainer against a reference that is not the trainer, and gradient clipping.

The reference (:func:`reference_run`) is a hand-written loop: the plain model
``usp.models.Llama(config, None)``, the data's global batch sequence by sequence, one
cross-entropy SUM over every label of the global batch divided by its label count, one
backward, ``clip_grad_norm_``, one AdamW with the config's settings and a learning rate
computed here from the warmup/cosine formula. It shares with the trainer only the model's
forward and the dataset (what both must read in the same order), so a wrong reduction in
the trainer -- a per-rank or per-micro-batch mean, FSDP averaging instead of summing,
logging one micro-batch's loss, a missing factor of the SP degree -- does not cancel out
as it does against a one-process run of the same trainer.

Checked for one process, u2 x r2 (zigzag), dp2 x r2 (contiguous, allgather ring) and u2 x
r2 with ``[parallel] token_placement = "documents"`` on 4 gloo ranks: every step's loss and gradient norm to 1e-5 relative and the exported final
weights to 2e-5 absolute (observed: at most 2.2e-7 relative and 6e-6 absolute).
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F
from train_cases import base_config
from usp_cases import topology

from usp.models import document_cost
from usp.sp.assignment import assign_documents
from usp.sp.plan import Plan
from usp.train import components
from usp.train.config import train_config_from_dict
from usp.train.data import IGNORE_INDEX, micro_batch_of
from usp.train.trainer import train

pytest.importorskip("safetensors", reason="the final weights are compared via the HF export")

TIMEOUT = 300
STEPS = 3


def job_config(**train) -> dict:
    """Accumulation on every layout (4 micro-batches in one process, 2 per dp replica),
    clipping active, weight decay and non-default Adam settings."""
    options = {"steps": STEPS, "global_batch": 8, "adam_betas": [0.9, 0.95], "grad_clip": 1.0,
               "seed": 5, "checkpoint_interval": 0, "export": True}  # fmt: skip
    return base_config(data={"synthetic_documents": 48}, **{**options, **train})


# ----------------------------------------------------------------------------- the reference
def reference_lr(t, step: int) -> float:
    """Linear warmup from lr/warmup, then cosine from lr to lr * min_lr_ratio at the
    last step (written out here, not taken from usp.train.schedule)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = t.steps - t.warmup_steps - 1
    progress = 1.0 if span <= 0 else min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def reference_run(config: dict):
    """Hand-written training: returns ``(losses, grad_norms, model)``."""
    from usp.models import Llama

    job = train_config_from_dict(config)
    t = job.train
    source = components.model_source(job)
    _, dataset = components.build_dataset(job, source, job.data.document_multiple)
    torch.manual_seed(t.seed)
    model = Llama(source.config, None)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": t.weight_decay}, {"params": vectors}],
        lr=t.lr,
        betas=tuple(t.adam_betas),
        eps=t.adam_eps,
        weight_decay=0.0,
    )
    losses, norms = [], []
    for step in range(t.steps):
        first = step * t.global_batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        count = 0
        for g in range(first, first + t.global_batch):
            row = micro_batch_of([dataset.sequence(g)])  # one sequence, its own boundaries
            logits = model(row.input_ids, cu_seqlens=row.cu_seqlens)  # [1, S, V]
            labels = row.labels[0]
            loss_sum = loss_sum + F.cross_entropy(
                logits[0].double(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            count += int((labels != IGNORE_INDEX).sum())
        loss = loss_sum / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf)
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(t, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, model


@pytest.fixture(scope="module")
def reference():
    config = job_config()
    losses, norms, model = reference_run(config)
    return config, losses, norms, model


# ----------------------------------------------------------------------------- comparisons
def _train_on_ranks(config, ulysses, ring, out, layout, ring_impl):
    job = train_config_from_dict(config)
    plan = Plan(topology(ulysses, ring), layout=layout, ring_impl=ring_impl, verify_calls=False)
    result = train(job, plan, output_dir=out, stream=io.StringIO())
    return [(r["loss"], r["grad_norm"], r["lr"]) for r in result.metrics]


def assert_matches_reference(rows, reference, out):
    from safetensors.torch import load_file

    config, losses, norms, model = reference
    t = train_config_from_dict(config).train
    assert len(rows) == len(losses) == STEPS
    for step, ((loss, norm, lr), ref_loss, ref_norm) in enumerate(zip(rows, losses, norms)):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)
        assert lr == pytest.approx(reference_lr(t, step), rel=1e-12), step
    assert norms[0] > t.grad_clip, "clipping was active"
    assert losses[-1] < losses[0], "the reference trains"
    weights = load_file(out / "hf" / "model.safetensors")
    start = Llama_state(config)
    ours = model.state_dict()
    assert weights.keys() == ours.keys()
    moved = 0.0
    for key, value in ours.items():
        torch.testing.assert_close(weights[key], value.detach(), rtol=0, atol=2e-5, msg=key)
        moved = max(moved, float((value - start[key]).abs().max()))
    assert moved > 1e-3, "the weights moved far more than the tolerance"


def Llama_state(config: dict) -> dict:  # noqa: N802 - the initial Llama's weights
    from usp.models import Llama

    job = train_config_from_dict(config)
    torch.manual_seed(job.train.seed)
    return Llama(components.model_source(job).config, None).state_dict()


def test_one_process_matches_the_reference_loop(reference, tmp_path):
    config = reference[0]
    result = train(train_config_from_dict(config), None, output_dir=tmp_path, stream=io.StringIO())
    rows = [(r["loss"], r["grad_norm"], r["lr"]) for r in result.metrics]
    assert_matches_reference(rows, reference, tmp_path)


def test_u2_r2_zigzag_matches_the_reference_loop(reference, distributed, tmp_path):
    config = reference[0]
    results = distributed.run(
        _train_on_ranks,
        config,
        2,
        2,
        str(tmp_path),
        "zigzag",
        "p2p",
        world_size=4,
        timeout=TIMEOUT,
    )
    assert all(r == results[0] for r in results), "every rank logs the same numbers"
    assert_matches_reference(results[0], reference, tmp_path)


def test_dp2_r2_contiguous_matches_the_reference_loop(reference, distributed, tmp_path):
    config = dict(reference[0], parallel={"ulysses": 1, "ring": 2, "dp": 2})
    results = distributed.run(
        _train_on_ranks,
        config,
        1,
        2,
        str(tmp_path),
        "contiguous",
        "allgather",
        world_size=4,
        timeout=TIMEOUT,
    )
    assert all(r == results[0] for r in results), "every rank logs the same numbers"
    assert_matches_reference(results[0], reference, tmp_path)


# ----------------------------------------------------------------------------- placement
#: one packed row of 128 tokens: on 4 ranks (32 tokens each) the 47 (padded to 48) is
#: split, the others computed whole (20, 20, 16 + 4 and 12 + 8 on the four ranks)
ROW = [47, 20, 19, 16, 12, 7, 4]


def placement_config(data_file) -> dict:
    """``[parallel] token_placement = "documents"`` on u2 x r2: rows of :data:`ROW`
    (documents padded to 4, the sequence multiple), in file order."""
    config = base_config(
        steps=STEPS, global_batch=4, seq_len=128, micro_batch=1, grad_clip=0.5, seed=5,
        checkpoint_interval=0, export=True,
    )  # fmt: skip
    config["data"] = {"source": "jsonl", "files": [str(data_file)], "tokenizer": "byte",
                      "shuffle": False, "document_multiple": 4}  # fmt: skip
    config["parallel"] = {"ulysses": 2, "ring": 2, "dp": 1, "token_placement": "documents"}
    return config


def write_rows(path, rows: int):
    gen = torch.Generator().manual_seed(11)  # counting sequences: learnable, the loss falls
    starts = torch.randint(0, 50, (rows * len(ROW),), generator=gen).tolist()
    lines = [
        json.dumps({"input_ids": [3 + (start + i) % 50 for i in range(n)]})
        for start, n in zip(starts, ROW * rows)
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_documents_placement_matches_the_reference_loop(distributed, tmp_path):
    """``usp train``'s plan (build_plan: the model's cost model) places each row's
    documents by length; every step's loss and gradient norm and the final weights equal
    the hand-written one-process loop's, also after a stop and ``--resume``."""
    config = placement_config(write_rows(tmp_path / "rows.jsonl", STEPS * 4))
    job = train_config_from_dict(config)
    _, dataset = components.build_dataset(job, components.model_source(job), 4)
    mixed = 0
    for g in range(STEPS * 4):
        bounds = micro_batch_of([dataset.sequence(g)]).cu_seqlens.tolist()
        a = assign_documents(bounds, ring=2, ulysses=2, layout="zigzag", multiple=4,
                             cost=document_cost(components.model_source(job).config))  # fmt: skip
        mixed += bool(a.split) and any(a.whole)
    assert mixed == STEPS * 4, "every row has split and whole documents"
    losses, norms, model = reference_run(config)
    out = tmp_path / "out"
    results = distributed.run(
        _train_with_plan_of_config, config, str(out), world_size=4, timeout=TIMEOUT
    )
    assert all(r == results[0] for r in results), "every rank logs the same numbers"
    assert_matches_reference(results[0], (config, losses, norms, model), out)
    # stopped after step 2 and resumed: step 3 is the reference's (the data position is
    # the loader's state; each row is placed again from its boundaries)
    resumed_config = dict(config, train={**config["train"], "checkpoint_interval": 1})
    resumed = distributed.run(
        _stop_then_resume, resumed_config, str(tmp_path / "resumed"), world_size=4,
        timeout=TIMEOUT,
    )[0]  # fmt: skip
    assert [row[0] for row in resumed] == [3]
    assert abs(resumed[0][1] - losses[2]) <= 1e-5 * losses[2], (resumed, losses)
    assert abs(resumed[0][2] - norms[2]) <= 1e-5 * norms[2], (resumed, norms)


def _stop_then_resume(config, out):
    job = train_config_from_dict(config)
    plan = components.build_plan(job, topology(2, 2))
    train(job, plan, output_dir=out, stop_after=2, stream=io.StringIO())
    result = train(job, plan, output_dir=out, resume=True, stream=io.StringIO())
    return [(r["step"], r["loss"], r["grad_norm"]) for r in result.metrics]


def _train_with_plan_of_config(config, out):
    job = train_config_from_dict(config)
    plan = components.build_plan(job, topology(2, 2))
    assert plan.placement == "documents" and plan.placement_cost.token_flops > 0
    result = train(job, plan, output_dir=out, stream=io.StringIO())
    return [(r["loss"], r["grad_norm"], r["lr"]) for r in result.metrics]


# ----------------------------------------------------------------------------- clipping
class RecordingSGD(torch.optim.SGD):
    """Plain SGD that records the norm of every update it makes."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.update_norms: list[float] = []

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        super().step(closure)
        squares = sum(float(((p - b) ** 2).sum()) for p, b in zip(params, before))
        self.update_norms.append(math.sqrt(squares))


def _train_with_sgd(monkeypatch, tmp_path, grad_clip: float):
    """One process with the trainer's AdamW swapped for RecordingSGD (a test hook only)."""
    made = []

    def sgd(job, model, levers):
        made.append(RecordingSGD(model.parameters(), lr=job.train.lr))
        return made[-1]

    monkeypatch.setattr(components, "build_optimizer", sgd)
    config = job_config(grad_clip=grad_clip, lr=0.05, steps=4, warmup_steps=0, export=False)
    out = tmp_path / f"clip{grad_clip}"
    rows = train(train_config_from_dict(config), None, output_dir=out, stream=io.StringIO()).metrics
    return rows, made[0].update_norms


def test_clipping_bounds_the_update_and_changes_training(monkeypatch, tmp_path):
    clip = 0.25
    clipped, clipped_updates = _train_with_sgd(monkeypatch, tmp_path, clip)
    free, free_updates = _train_with_sgd(monkeypatch, tmp_path, 0.0)
    assert all(r["grad_norm"] > clip for r in clipped), "every step's norm exceeds the clip"
    for row, update in zip(clipped, clipped_updates):
        # SGD moves by lr * clipped gradient: exactly lr * clip when the norm is above it
        assert update <= row["lr"] * clip * (1 + 1e-5), (row["step"], update)
        assert update == pytest.approx(row["lr"] * clip, rel=1e-4), row["step"]
    for row, update in zip(free, free_updates):
        assert update == pytest.approx(row["lr"] * row["grad_norm"], rel=1e-4), row["step"]
        assert update > row["lr"] * clip * 2, "unclipped steps are larger"
    assert clipped[0]["loss"] == free[0]["loss"], "the same first step"
    assert clipped[0]["grad_norm"] == free[0]["grad_norm"]
    for a, b in zip(clipped[1:], free[1:]):
        assert abs(a["loss"] - b["loss"]) > 1e-4 * b["loss"], "clipping changed step 2 on"

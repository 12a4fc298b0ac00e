"""Shared pieces of the trainer tests (tests/train/): a tiny job as a config dict, the
body that trains it on every rank of a cached topology, and the comparison of its
metrics with a single-process run (moved from test_train_dist.py with their names,
which the trainer tests import from here)."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from model_cases import closed_form_aux, load_hf_reference
from usp_cases import topology

from usp.train import components
from usp.train.components import build_plan
from usp.train.config import train_config_from_dict
from usp.train.data import IGNORE_INDEX, micro_batch_of
from usp.train.trainer import train

#: the steps of ``base_config``'s job
STEPS = 4


def base_config(*, data: dict | None = None, **train) -> dict:
    """A tiny job: 2-layer preset, generated documents, 64-token sequences; ``data`` and
    ``train`` override keys of those sections."""
    return {
        "cluster": {"nodes": 1, "gpus_per_node": 4},
        "parallel": {"ulysses": 2, "ring": 2, "dp": 1},
        "model": {"preset": "tiny"},
        "data": {
            "source": "synthetic",
            "synthetic_documents": 64,
            "synthetic_length": 24,
            "document_multiple": 8,  # fits every layout of these tests: same data everywhere
            **(data or {}),
        },
        "train": {
            "steps": STEPS,
            "global_batch": 4,
            "seq_len": 64,
            "micro_batch": 2,
            "lr": 3e-3,
            "warmup_steps": 1,
            "min_lr_ratio": 0.2,
            "weight_decay": 0.1,
            "adam_betas": [0.9, 0.99],
            "adam_eps": 1e-7,
            "grad_clip": 0.5,  # below the first steps' norms: clipping is active
            "seed": 3,
            "dtype": "float32",
            "checkpoint_interval": 2,
            "keep_checkpoints": 2,
            "export": False,
            **train,
        },
    }


def _train_on_ranks(config, ulysses, ring, out, resume=False, stop_after=None, layout=None):
    """Body for every rank: the job on a cached (ulysses, ring) topology."""
    job = train_config_from_dict(config, layout=layout)  # None: the config's layout
    plan = build_plan(job, topology(ulysses, ring))  # verify_calls as usp train has it
    result = train(
        job, plan, output_dir=out, resume=resume, stop_after=stop_after, stream=io.StringIO()
    )
    return [(r["step"], r["loss"], r["grad_norm"]) for r in result.metrics]


def _relative(a: float, b: float) -> float:
    """|a - b| relative to |b|."""
    return abs(a - b) / max(abs(b), 1e-12)


def assert_matches_single(rows, reference, *, first_loss_tol=1e-5, tol=1e-4):
    assert [r[0] for r in rows] == [r["step"] for r in reference]
    assert abs(rows[0][1] - reference[0]["loss"]) <= first_loss_tol, (rows[0], reference[0])
    for (step, loss, norm), ref in zip(rows, reference):
        assert _relative(loss, ref["loss"]) <= tol, (step, loss, ref["loss"])
        assert _relative(norm, ref["grad_norm"]) <= tol, (step, norm, ref["grad_norm"])


def moe_job(checkpoint) -> dict:
    """``base_config`` for 2 steps on an HF checkpoint with the byte tokenizer."""
    config = base_config(steps=2, checkpoint_interval=0)
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    return config


def transformers_first_loss(
    config: dict, coef: float | None = None, *, with_aux: bool = False, load=load_hf_reference
):
    """transformers' float64 step-1 loss: each micro-batch's documents run alone; CE sum
    over all micro-batches / the step's label count + coef * each micro-batch's aux
    (``with_aux``: ``(loss, the micro-batches' mean aux)``). ``coef`` None: the
    checkpoint's ``router_aux_loss_coef`` if its config sets ``output_router_logits``,
    else no aux; ``load``: the reference's loader (a family's float64 patches)."""
    job = train_config_from_dict(config)
    source = components.model_source(job)
    _, dataset = components.build_dataset(job, source, job.data.document_multiple)
    model = load(source.directory)
    cfg = model.config
    moe = coef is not None or bool(getattr(cfg, "output_router_logits", False))
    if coef is None:
        coef = cfg.router_aux_loss_coef if moe else 0.0
    router_kwargs = {"output_router_logits": True} if moe else {}
    total, count, aux = 0.0, 0, 0.0
    per_micro = job.train.micro_batch
    with torch.no_grad():
        for first in range(0, job.train.global_batch, per_micro):
            row = micro_batch_of([dataset.sequence(g) for g in range(first, first + per_micro)])
            bounds = row.cu_seqlens.tolist()
            router = []
            for a, b in zip(bounds, bounds[1:]):
                out = model(row.input_ids[:, a:b], use_cache=False, **router_kwargs)
                labels = row.labels[0, a:b]
                total += F.cross_entropy(
                    out.logits[0], labels, ignore_index=IGNORE_INDEX, reduction="sum"
                ).item()
                count += int((labels != IGNORE_INDEX).sum())
                router.extend(out.router_logits if moe else ())
            if moe:
                aux += closed_form_aux(router, cfg.num_experts, cfg.num_experts_per_tok).item()
    loss = total / count + coef * aux
    return (loss, aux / (job.train.global_batch // per_micro)) if with_aux else loss

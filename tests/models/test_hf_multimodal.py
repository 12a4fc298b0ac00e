"""``usp.models.hf.shard_multimodal``: tiny Qwen3-VL, Qwen3.5 (multimodal, Gated DeltaNet
swapped; images and a video) and Gemma 3 (multimodal: bidirectional image blocks) on 4
gloo ranks (u2 x r2 zigzag, u1 x r4 contiguous) and in one process (``Plan(None)``),
dense and with packed documents holding images, against transformers' own model in one
process on the whole batch (document by document when packed), float32:

* the gathered logits within 1e-4 of transformers';
* ``sp_loss`` equal to the reference loss (1e-5 relative), the labels masked at the
  placeholder tokens (in one process also the chunked ``causal_lm_loss``);
* every parameter's gradient, vision tower included, summed over the SP ranks, within
  1e-4 relative of transformers'.

The references are computed once in the test process and handed to the ranks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import vl_cases
from reference import relative_error
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.25")

import usp  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shift_labels  # noqa: E402

LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4
#: per kind: the dense batch (32 tokens) and the packed one (documents of 16 and 16)
CASES = {
    "qwen3_vl": ([3, ("image", 4, 4), 9, ("image", 2, 4), 3, ("image", 4, 2), 3],
                 [[4, ("image", 4, 4), 6], [2, ("image", 4, 4), 1, ("image", 2, 2), 4]]),
    "qwen3_5": ([3, ("image", 4, 4), 3, ("video", 2, 2, 4), 4, ("image", 2, 2), 5],
                [[4, ("image", 4, 4), 6], [2, ("video", 2, 2, 2), 8]]),
    "gemma3": ([2, ("image",), 4, ("image",), 5, ("image",), 3],
               [[3, ("image",), 7], [1, ("image",), 1, ("image",), 2]]),
}  # fmt: skip
GRIDS = {"u2r2": ((2, 2), "zigzag"), "u1r4": ((1, 4), "contiguous")}


def _quiet():
    warnings.simplefilter("ignore")  # transformers' slow-path notes (GDN on CPU)


def _labels(ids):
    placeholders = (ids >= vl_cases.IMAGE) & (ids <= vl_cases.VIDEO)
    return ids.masked_fill(placeholders, -100)


def global_batch(kind: str, packed: bool) -> dict:
    """The global batch: input_ids, labels, the processor's outputs, and the documents'
    bounds (a batch of each document concatenated when packed)."""
    dense, docs = CASES[kind]
    if not packed:
        inputs = vl_cases.batch(kind, dense, seed=1)
        inputs["bounds"] = [0, inputs["input_ids"].shape[1]]
        return inputs
    parts = [vl_cases.batch(kind, doc, seed=2 + i) for i, doc in enumerate(docs)]
    inputs = {"bounds": [0]}
    for part in parts:
        inputs["bounds"].append(inputs["bounds"][-1] + part["input_ids"].shape[1])
    for key in sorted({key for part in parts for key in part}):
        dim = 1 if key in ("input_ids", "mm_token_type_ids", "token_type_ids") else 0
        inputs[key] = torch.cat([p[key] for p in parts if key in p], dim=dim)
    return inputs


def _document(kind, inputs, a, b):
    """The processor outputs of the document [a, b) of a packed batch."""
    ids = inputs["input_ids"][:, a:b]
    doc = {"input_ids": ids}
    types_key = "token_type_ids" if kind == "gemma3" else "mm_token_type_ids"
    doc[types_key] = inputs[types_key][:, a:b]
    if kind == "gemma3":
        before = int((inputs["input_ids"][:, :a] == vl_cases.IMAGE).sum()) // 4
        count = int((ids == vl_cases.IMAGE).sum()) // 4
        if count:
            doc["pixel_values"] = inputs["pixel_values"][before : before + count]
        return doc
    for token, pixels, grids in (
        (vl_cases.IMAGE, "pixel_values", "image_grid_thw"),
        (vl_cases.VIDEO, "pixel_values_videos", "video_grid_thw"),
    ):
        if grids not in inputs:
            continue
        tokens = (inputs[grids].prod(-1) // 4).tolist()
        rows = inputs[grids].prod(-1).tolist()
        seen = int((inputs["input_ids"][:, :a] == token).sum())
        here = int((ids == token).sum())
        first, done = 0, 0
        while done < seen:
            done += tokens[first]
            first += 1
        last, got = first, 0
        while got < here:
            got += tokens[last]
            last += 1
        if last > first:
            doc[grids] = inputs[grids][first:last]
            doc[pixels] = inputs[pixels][sum(rows[:first]) : sum(rows[:last])]
    return doc


def reference(kind: str, packed: bool) -> dict:
    """transformers in one process (sdpa, float32): logits, the mean loss over the
    globally shifted labels (per document), every parameter's gradient."""
    _quiet()
    inputs = global_batch(kind, packed)
    model = vl_cases.build(kind)
    bounds = inputs["bounds"]
    logits = []
    for a, b in zip(bounds, bounds[1:]):
        doc = _document(kind, inputs, a, b) if packed else inputs
        doc = {k: v for k, v in doc.items() if k != "bounds"}
        logits.append(model(**doc, use_cache=False).logits)
    logits = torch.cat(logits, dim=1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    labels = shift_labels(_labels(inputs["input_ids"]), cu_seqlens=cu)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads}


def sp_run(plan, kind, packed, expected, chunked: bool = False) -> dict:
    """One case on this rank: shard_multimodal, the forward, sp_loss (``chunked``: the
    chunked loss inside the model's forward, no logits), the backward; the errors
    against ``expected``."""
    _quiet()
    name = usp_hf.register(plan, name=f"usp_mm_{kind}")
    model = vl_cases.build(kind, attn_implementation=name)
    if kind == "qwen3_5":
        assert usp_hf.swap_linear_attention(model, plan) == 1
    usp_hf.register(plan, name=name, model=model)
    inputs = global_batch(kind, packed)
    bounds = inputs.pop("bounds")
    ids = inputs.pop("input_ids")
    cu = torch.tensor(bounds, dtype=torch.int32) if packed else None
    batch = usp_hf.shard_multimodal(plan, model, ids, labels=_labels(ids), cu_seqlens=cu,
                                    **inputs)  # fmt: skip
    if chunked:
        logits = None
        loss = usp_hf.causal_lm_loss(model, batch, plan, chunk_tokens=5)
    else:
        logits = model(**batch.hf_kwargs()).logits  # [1, S/P, V]
        loss = usp_hf.sp_loss(logits, batch.labels, plan)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if plan.sp_degree > 1:  # every parameter, so that a missing gradient shows as one
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, torch.zeros_like(p))
            dist.all_reduce(grads[n], group=plan.sp_group)
        logits = None if chunked else plan.gather(logits.detach(), packed=batch.packed)
    errors = {}
    if logits is not None:
        errors["logits"] = relative_error(logits.detach(), expected["logits"])
    errors["loss"] = abs(loss.item() - expected["loss"]) / abs(expected["loss"])
    missing = sorted(set(expected["grads"]) - set(grads))
    errors["missing gradients"] = float(len(missing))
    for n, g in expected["grads"].items():
        if n in grads:
            errors[n] = relative_error(grads[n], g)
    return errors


def _failures(label, errors) -> list[str]:
    limits = {"logits": LOGITS_TOL, "loss": LOSS_TOL, "missing gradients": 0.0}
    return [
        f"{label}: {name} {err:.3g}"
        for name, err in errors.items()
        if not err <= limits.get(name, GRAD_TOL)
    ]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_shard_multimodal_in_one_process(kind):
    """Dense and packed with the logits' loss; packed with the chunked loss too."""
    failures = []
    for packed, chunked in ((False, False), (True, False), (True, True)):
        errors = sp_run(usp.Plan(None), kind, packed, reference(kind, packed), chunked)
        failures += _failures(f"{kind} packed={packed} chunked={chunked}", errors)
    assert not failures, "\n".join(failures)


def run_grid(kind, grid, expected):
    (u, r), layout = GRIDS[grid]
    plan = usp.Plan(topology(u, r), layout=layout)
    return [sp_run(plan, kind, packed, expected[packed]) for packed in (False, True)]


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("kind", sorted(CASES))
def test_shard_multimodal_under_sp_matches_transformers(distributed, kind, grid):
    expected = {packed: reference(kind, packed) for packed in (False, True)}
    results = distributed.run(run_grid, kind, grid, expected, world_size=4, timeout=600)
    failures = []
    for rank, cases in enumerate(results):
        for packed, errors in zip((False, True), cases):
            failures += _failures(f"rank {rank} {kind} {grid} packed={packed}", errors)
    assert not failures, "\n".join(failures)

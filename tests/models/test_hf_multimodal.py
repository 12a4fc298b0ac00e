"""``usp.models.hf.shard_multimodal``: tiny Qwen3-VL, Qwen3.5 (multimodal, Gated DeltaNet
swapped; images and a video) and Gemma 3 (multimodal: bidirectional image blocks) on 4
gloo ranks (u2 x r2 zigzag, u1 x r4 contiguous; Qwen3-VL-MoE u2 x r2) and in one process
(``Plan(None)``), on one row, on two documents holding images packed in one row and on
two rows, against transformers' own model in one process on the whole batch (document
by document when packed), float32:

* the gathered logits within 1e-4 of transformers';
* ``sp_loss`` equal to the reference loss (1e-5 relative), the labels masked at the
  placeholder tokens (in one process also the chunked ``causal_lm_loss``);
* every parameter's gradient, vision tower included, summed over the SP ranks, within
  1e-4 relative of transformers'.

The references are computed once in the test process and handed to the ranks.
"""

from __future__ import annotations

import types
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import vl_cases
from reference import relative_error
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.25")

import usp  # noqa: E402
from usp.errors import UspError  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shift_labels  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

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
CASES["qwen3_vl_moe"] = CASES["qwen3_vl"]  # the MoE variant: the same code, experts
GRIDS = {"u2r2": ((2, 2), "zigzag"), "u1r4": ((1, 4), "contiguous")}
SP_CASES = [(k, g) for k in ("gemma3", "qwen3_5", "qwen3_vl") for g in GRIDS]
SP_CASES.append(("qwen3_vl_moe", "u2r2"))


def _quiet():
    warnings.simplefilter("ignore")  # transformers' slow-path notes (GDN on CPU)


def _labels(ids):
    placeholders = (ids >= vl_cases.IMAGE) & (ids <= vl_cases.VIDEO)
    return ids.masked_fill(placeholders, -100)


PER_TOKEN = ("input_ids", "mm_token_type_ids", "token_type_ids")


def _joined(parts: list[dict], token_dim: int) -> dict:
    """Batches joined: per-token inputs along ``token_dim``, media one after the other."""
    inputs = {}
    for key in sorted({key for part in parts for key in part}):
        dim = token_dim if key in PER_TOKEN else 0
        inputs[key] = torch.cat([p[key] for p in parts if key in p], dim=dim)
    return inputs


def global_batch(kind: str, case: str, dtype=torch.float32) -> dict:
    """The global batch of ``case``: "dense" (one row of 32 tokens), "packed" (two
    documents of 16 in one row) or "rows" (both as two rows): input_ids, the processor's
    outputs (pixels in ``dtype``), and the documents' bounds."""
    dense, docs = CASES[kind]
    first = vl_cases.batch(kind, dense, seed=1)
    parts = [vl_cases.batch(kind, doc, seed=2 + i) for i, doc in enumerate(docs)]
    lengths = [p["input_ids"].shape[1] for p in parts]
    inputs = {
        "dense": lambda: first,
        "packed": lambda: _joined(parts, 1),
        "rows": lambda: _joined([first, _joined(parts, 1)], 0),
    }[case]()
    bounds = [0, lengths[0], sum(lengths)] if case == "packed" else [0, 32]
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return {**inputs, "bounds": bounds}


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


def reference(kind: str, case: str, dtype=torch.float32) -> dict:
    """transformers in one process (sdpa, ``dtype``): logits, the mean loss over the
    globally shifted labels (per document), every parameter's gradient."""
    _quiet()
    inputs = global_batch(kind, case, dtype)
    packed = case == "packed"
    model = vl_cases.build(kind, dtype=dtype)
    bounds = inputs["bounds"]
    logits = []
    for a, b in zip(bounds, bounds[1:]):
        doc = _document(kind, inputs, a, b) if packed else inputs
        doc = {k: v for k, v in doc.items() if k != "bounds"}
        logits.append(model(**doc, use_cache=False).logits)
    logits = torch.cat(logits, dim=1)
    cu = torch.tensor(bounds, dtype=torch.int32) if packed else None
    labels = shift_labels(_labels(inputs["input_ids"]), cu_seqlens=cu)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads}


class _References(dict):
    """:func:`reference` of each ``(kind, case, dtype)``, computed when first asked for
    (the tests only read them)."""

    def __missing__(self, key):
        self[key] = reference(*key)
        return self[key]


@pytest.fixture(scope="module")
def references():
    return _References()


def sp_model(plan, kind, dtype=torch.float32):
    """The tiny model of ``kind`` with USP attention on ``plan`` (Qwen3.5's Gated
    DeltaNet swapped), given to ``register``."""
    _quiet()
    name = usp_hf.register(plan, name=f"usp_mm_{kind}")
    model = vl_cases.build(kind, attn_implementation=name, dtype=dtype)
    if kind == "qwen3_5":
        assert usp_hf.swap_linear_attention(model, plan) == 1
    usp_hf.register(plan, name=name, model=model)
    return model


def sp_run(
    plan, kind, case, expected, chunked=False, ignore_index=-100, dtype=torch.float32, model=None
) -> dict:
    """One case on this rank: shard_multimodal, the forward, sp_loss (``chunked``: the
    chunked loss inside the model's forward, no logits), the backward; the errors
    against ``expected``. Another ``ignore_index`` also passes an all-ones
    ``attention_mask`` (what a processor returns). ``model``: a :func:`sp_model` of
    ``kind`` on ``plan`` to reuse (its gradients are cleared first), else a new one."""
    _quiet()
    if model is None:
        model = sp_model(plan, kind, dtype)
    model.zero_grad(set_to_none=True)
    inputs = global_batch(kind, case, dtype)
    bounds = inputs.pop("bounds")
    ids = inputs.pop("input_ids")
    cu = torch.tensor(bounds, dtype=torch.int32) if case == "packed" else None
    labels = _labels(ids).masked_fill(_labels(ids) == -100, ignore_index)
    if ignore_index != -100:
        inputs.update(ignore_index=ignore_index, attention_mask=torch.ones_like(ids))
    batch = usp_hf.shard_multimodal(plan, model, ids, labels=labels, cu_seqlens=cu, **inputs)
    if chunked:
        logits = None
        loss = usp_hf.causal_lm_loss(model, batch, plan, chunk_tokens=5)
    else:
        logits = model(**batch.hf_kwargs()).logits  # [1, S/P, V]
        loss = usp_hf.sp_loss(logits, batch.labels, plan, ignore_index=ignore_index)
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


def _failures(label, errors, tol=None) -> list[str]:
    """The errors above their limits (``tol``: one limit for all, float64's)."""
    limits = {"logits": LOGITS_TOL, "loss": LOSS_TOL, "missing gradients": 0.0}
    if tol is not None:
        limits = {"logits": tol, "loss": tol, "missing gradients": 0.0}
    return [
        f"{label}: {name} {err:.3g}"
        for name, err in errors.items()
        if not err <= limits.get(name, GRAD_TOL if tol is None else tol)
    ]


BATCHES = ("dense", "packed", "rows")


@pytest.mark.parametrize("kind", sorted(CASES))
def test_shard_multimodal_in_one_process(references, kind):
    """Every batch with the logits' loss; packed with the chunked loss too (one model)."""
    failures = []
    plan = usp.Plan(None)
    model = sp_model(plan, kind)
    for case, chunked in (*((c, False) for c in BATCHES), ("packed", True)):
        expected = references[kind, case, torch.float32]
        errors = sp_run(plan, kind, case, expected, chunked, model=model)
        failures += _failures(f"{kind} {case} chunked={chunked}", errors)
    assert not failures, "\n".join(failures)


def run_grid(kind, grid, expected):
    """Every batch; on u1 x r4 the two rows with ``ignore_index=-7`` and a mask of ones."""
    (u, r), layout = GRIDS[grid]
    plan = usp.Plan(topology(u, r), layout=layout)
    ignore = {case: -7 if (grid, case) == ("u1r4", "rows") else -100 for case in BATCHES}
    model = sp_model(plan, kind)
    return [
        sp_run(plan, kind, c, expected[c], ignore_index=ignore[c], model=model) for c in BATCHES
    ]


@pytest.mark.parametrize("kind, grid", SP_CASES, ids=[f"{k}-{g}" for k, g in SP_CASES])
def test_shard_multimodal_under_sp_matches_transformers(distributed, references, kind, grid):
    expected = {case: references[kind, case, torch.float32] for case in BATCHES}
    results = distributed.run(run_grid, kind, grid, expected, world_size=4, timeout=600)
    failures = []
    for rank, cases in enumerate(results):
        for case, errors in zip(BATCHES, cases):
            failures += _failures(f"rank {rank} {kind} {grid} {case}", errors)
    assert not failures, "\n".join(failures)


# float64 models: transformers still computes their norms (``x.float()``) and RoPE angles
# in float32, so two exact computations differ by float32 rounding there (seen ~1e-7).
# Not Qwen3.5: transformers runs its Gated DeltaNet in float32 too, and the decay
# parameters' gradients of these tiny models are ~1e-8, where that rounding is 1-5%.
F64_CASES, F64_TOL = (("gemma3", "packed"), ("qwen3_vl", "packed")), 1e-6


def run_float64(expected):
    plan = usp.Plan(topology(2, 2), layout="zigzag")
    return [sp_run(plan, k, c, expected[k], dtype=torch.float64) for k, c in F64_CASES]


def test_float64_under_sp_matches_transformers_to_rounding(distributed, references):
    """Gemma 3 (image blocks split over ranks) and Qwen3-VL (multimodal positions,
    deepstack), packed, u2 x r2, float64: logits, loss and every gradient within 1e-6
    relative."""
    expected = {k: references[k, c, torch.float64] for k, c in F64_CASES}
    results = distributed.run(run_float64, expected, world_size=4, timeout=600)
    failures = []
    for rank, cases in enumerate(results):
        for (kind, case), errors in zip(F64_CASES, cases):
            failures += _failures(f"rank {rank} {kind} {case} float64", errors, F64_TOL)
    assert not failures, "\n".join(failures)
    worst = max(max(e.values()) for cases in results for e in cases)
    print(f"float64: largest relative error {worst:.3g}")


def test_ignore_index_and_a_mask_of_ones_in_one_process(references):
    """``ignore_index`` other than -100 and an all-ones ``attention_mask`` (what a
    processor returns): the same loss as the reference."""
    _quiet()
    expected = references["qwen3_vl", "dense", torch.float32]["loss"]
    plan = usp.Plan(None)
    name = usp_hf.register(plan, name="usp_mm_ignore")
    model = vl_cases.build("qwen3_vl", attn_implementation=name)
    inputs = global_batch("qwen3_vl", "dense")
    inputs.pop("bounds")
    ids = inputs.pop("input_ids")
    labels = _labels(ids).masked_fill(_labels(ids) == -100, -7)
    batch = usp_hf.shard_multimodal(plan, model, ids, labels=labels, ignore_index=-7,
                                    attention_mask=torch.ones_like(ids), **inputs)  # fmt: skip
    assert int((batch.labels == -7).sum()) == int((_labels(ids) == -100).sum()) + 1
    logits = model(**batch.hf_kwargs()).logits
    loss = usp_hf.sp_loss(logits, batch.labels, plan, ignore_index=-7)
    assert abs(loss.item() - expected) <= LOSS_TOL * abs(expected)


def run_refusals():
    """Bad inputs given to shard_multimodal (on every rank, or on one): the same error
    on every rank before anything else is exchanged; the group stays usable."""
    _quiet()
    plan = usp.Plan(topology(2, 2))
    name = usp_hf.register(plan, name="usp_mm_refusals")
    model = vl_cases.build("qwen3_vl", attn_implementation=name)
    sdpa = vl_cases.build("qwen3_vl")
    inputs = global_batch("qwen3_vl", "dense")
    inputs.pop("bounds")
    ids = inputs.pop("input_ids")
    rank = dist.get_rank(plan.sp_group)
    other_pixels = dict(inputs, pixel_values=inputs["pixel_values"] + float(rank == 1))
    padded = torch.ones_like(ids).index_fill(1, torch.tensor([31]), int(rank != 2))
    # Qwen3.5's MoE variant, not placed yet (what shard_multimodal reads first: its config)
    moe = types.SimpleNamespace(config=transformers.Qwen3_5MoeConfig())
    cases = {
        "another model type": (moe, inputs),
        "media differ": (model, other_pixels),
        "unplaced output": (model, dict(inputs, image_sizes=torch.ones(3, 2))),
        "tokens and pixels": (model, dict(inputs, image_grid_thw=inputs["image_grid_thw"][:2],
                                          pixel_values=inputs["pixel_values"][:24])),
        "padding on rank 2": (model, dict(inputs, attention_mask=padded)),
        "not usp's attention": (sdpa, inputs),
    }  # fmt: skip
    plan.sp_group.set_timeout(timedelta(seconds=30))  # a missed agreement fails fast
    messages = {}
    try:
        for case, (which, given) in cases.items():
            try:
                usp_hf.shard_multimodal(plan, which, ids, **given)
            except UspError as err:
                messages[case] = f"{type(err).__name__}: {err}"
    finally:
        plan.sp_group.set_timeout(timedelta(seconds=600))
    check = torch.ones(1)
    dist.all_reduce(check, group=plan.sp_group)
    return messages, float(check)


def test_bad_inputs_are_one_error_on_every_rank(distributed):
    results = distributed.run(run_refusals, world_size=4, timeout=300)
    expected = {  # the error's class and what its message says
        "another model type": ("HFInputError", "does not know SimpleNamespace (model_type "
                               "'qwen3_5_moe'); it computes qwen3_vl, qwen3_vl_moe, qwen3_5"),
        "media differ": ("RankDisagreementError", "disagree on media"),
        "unplaced output": ("HFInputError", "failed on ranks 0, 1, 2, 3 of 4: shard_multimodal "
                            "got image_sizes"),
        "tokens and pixels": ("HFInputError", "the batch has 8 image placeholder tokens (id 60) but its pixel_values make 6"),
        "padding on rank 2": ("HFInputError", "failed on rank 2 of 4: shard_multimodal got an "
                              "attention_mask with padding"),
        "not usp's attention": ("HFInputError", "attention is 'sdpa', not USP attention"),
    }  # fmt: skip
    assert [c for _, c in results] == [4.0] * 4
    for rank, (messages, _) in enumerate(results):
        assert messages.keys() == expected.keys(), (rank, messages)
        for case, (kind, says) in expected.items():
            assert messages[case].startswith(kind) and says in messages[case], (rank, case)

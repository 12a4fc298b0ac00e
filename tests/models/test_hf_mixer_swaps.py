"""transformers' Kimi-Linear (Kimi Delta Attention), LFM2 / LFM2-MoE / LFM3 (short convs)
and Jamba (Mamba-1) under SP through the HF plug-in, their mixers computed by usp
(``usp.models.hf.swap_linear_attention``, issue 57). Logits and every parameter gradient
on 4 gloo ranks (u2 x r2 zigzag dense and packed, u1 x r4 contiguous packed) against
transformers in one process (document by document when packed: its torch paths have no
documents), float32, 1e-4. Jamba's decoder layer does not pass packed documents on to
its mixer: its packed forward is refused, and its dense case runs on every grid instead.
Several models per launch: the harness runs one body over the cases.
"""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist
from hybrid_cases import HYBRID, build, reference_by_document, swap_batch
from reference import relative_error
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.25")

import usp  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shard_batch  # noqa: E402
from usp.models.hf_mixers import mixer_problem  # noqa: E402
from usp.models.hf_swap import USP_MIXERS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-4  # float32, transformers' order of operations against usp's
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
_CONV_THEN_ATTENTION = ["conv", "full_attention"]
#: (model type, its settings beyond hybrid_cases.COMMON)
MODELS = [
    ("kimi_linear", HYBRID["kimi_linear"]),
    ("lfm2", {**HYBRID["lfm2"], "conv_bias": True, "conv_L_cache": 4}),  # not the defaults
    ("lfm2_moe", dict(layer_types=_CONV_THEN_ATTENTION, num_dense_layers=1, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, **_TOKENS)),
    ("lfm3", dict(layer_types=_CONV_THEN_ATTENTION, **_TOKENS)),
    ("jamba", {**HYBRID["jamba"], "mamba_proj_bias": True}),  # not the default
]  # fmt: skip
#: models whose decoder layer does not pass packed documents on to the mixer: refused
NOT_PACKED = {"jamba": "JambaMambaDecoderLayer (model.layers.0) was called with packed documents"}


def run_swapped_models(ulysses, ring, layout, packed, models):
    plan = usp.Plan(topology(ulysses, ring), layout=layout)
    name = usp_hf.register(plan, name=f"usp_swaps_{ulysses}{ring}{layout}{int(packed)}")
    cu, ids, dlogits = swap_batch(plan, layout, packed, seed=6, lowest_id=1)
    results = {}
    for model_type, settings in models:
        if packed and model_type in NOT_PACKED:  # refused packed; its dense case on this grid
            refusal = _refusal(plan, name, model_type, settings, ids, cu)
            dense = _compare(plan, name, model_type, settings, ids[:, :16], dlogits[:, :16], None)
            results[model_type] = (refusal, dense)
        else:
            results[model_type] = _compare(plan, name, model_type, settings, ids, dlogits, cu)
    return results


def _compare(plan, name, model_type, settings, ids, dlogits, cu):
    """The swapped model under ``plan`` against transformers' in one process: the errors
    of the logits and of every parameter's gradient, the swaps, the usp mixers, and
    whether the model was refused before the swap."""
    seq = ids.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, expected, expected_grads = reference_by_document(
            model_type, settings, ids, dlogits, [0, seq] if cu is None else cu.tolist()
        )
        model = build(model_type, settings, attn_implementation=name)
        model.load_state_dict(reference.state_dict())
        refused_before = mixer_problem(model, plan) is not None
        swapped = usp_hf.swap_linear_attention(model, plan)
        usp_hf.register(plan, name=name, model=model)  # accepted now: checks this model
        local = model(**shard_batch(plan, ids, cu_seqlens=cu).hf_kwargs()).logits
        local.backward(plan.shard(dlogits, packed=cu))
    for p in model.parameters():  # replicated weights: the sum over the SP ranks
        dist.all_reduce(p.grad, group=plan.sp_group)
    errors = {"logits": relative_error(plan.gather(local.detach(), packed=cu), expected)}
    errors.update(
        {n: relative_error(p.grad, expected_grads[n]) for n, p in model.named_parameters()}
    )
    mixers = sum(isinstance(m, USP_MIXERS) for m in model.modules())
    return errors, swapped, mixers, refused_before


def _refusal(plan, name, model_type, settings, ids, cu):
    """The swapped model's packed forward: the refusal's message (or "no error")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type, settings, attn_implementation=name)
        usp_hf.swap_linear_attention(model, plan)
        usp_hf.register(plan, name=name, model=model)
        try:
            model(**shard_batch(plan, ids, cu_seqlens=cu).hf_kwargs())
        except Exception as err:  # noqa: BLE001 - the test reads type and text
            return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    "grid, layout, packed",
    [((2, 2), "zigzag", False), ((1, 4), "contiguous", True), ((2, 2), "zigzag", True)],
    ids=["u2r2-zigzag-dense", "u1r4-contiguous-packed", "u2r2-zigzag-packed"],
)
def test_swapped_mixers_under_sp_match_transformers(distributed, grid, layout, packed):
    results = distributed.run(run_swapped_models, *grid, layout, packed, MODELS, world_size=4,
                              timeout=600)  # fmt: skip
    failures = []
    for rank, per_model in enumerate(results):
        assert len(per_model) == len(MODELS)
        for model, result in per_model.items():
            if packed and model in NOT_PACKED:
                refusal, result = result
                assert refusal.startswith("ModelConfigError"), refusal
                assert NOT_PACKED[model] in refusal, refusal
            errors, swapped, mixers, refused_before = result
            assert swapped >= 1 and mixers == swapped and refused_before, model
            failures += [f"{model} r{rank} {n}: {e:.3g}" for n, e in errors.items()
                         if not e < TOL]  # fmt: skip
    assert not failures, "\n".join(failures)

"""transformers' Mamba-2 hybrids under SP through the HF plug-in, their Mamba-2 layers
computed by usp (``usp.models.hf.swap_linear_attention``, issue 57): Bamba, Granite 4
hybrid, Nemotron-H, Falcon-H1 (with and without its gated norm) and Zamba2. Logits and
every parameter gradient on 4 gloo ranks (u2 x r2 and u1 x r4; dense and packed documents)
against transformers in one process (document by document when packed: its torch path
has no documents), float32, 1e-4. Several models per launch: the harness runs one body
over the cases.
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
from usp.linear.mamba2_module import Mamba2Mixer  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shard_batch  # noqa: E402
from usp.models.hf_mixers import mixer_problem  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-4  # float32, transformers' order of operations against usp's
#: (model type, its settings beyond hybrid_cases.HYBRID)
MODELS = [
    ("bamba", {}),
    ("granitemoehybrid", {}),
    ("nemotron_h", {}),
    ("falcon_h1", {}),
    ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}),
    ("zamba2", {}),
]


def _settings(model_type, extra):
    return {**HYBRID[model_type], **extra}


def run_mamba2_models(ulysses, ring, layout, packed, models):
    plan = usp.Plan(topology(ulysses, ring), layout=layout)
    name = usp_hf.register(plan, name=f"usp_mamba2_{ulysses}{ring}{layout}{int(packed)}")
    cu, ids, dlogits = swap_batch(plan, layout, packed, seed=5, lowest_id=0)
    seq = ids.shape[1]
    results = {}
    for model_type, extra in models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference, expected, expected_grads = reference_by_document(
                model_type,
                _settings(model_type, extra),
                ids,
                dlogits,
                cu.tolist() if packed else [0, seq],
            )
            model = build(model_type, _settings(model_type, extra), attn_implementation=name)
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
        mixers = sum(isinstance(m, Mamba2Mixer) for m in model.modules())
        results[f"{model_type}{extra or ''}"] = (errors, swapped, mixers, refused_before)
    return results


@pytest.mark.parametrize(
    "grid, layout, packed",
    [((2, 2), "zigzag", False), ((1, 4), "contiguous", True), ((2, 2), "zigzag", True)],
    ids=["u2r2-zigzag-dense", "u1r4-contiguous-packed", "u2r2-zigzag-packed"],
)
def test_mamba2_hybrids_under_sp_match_transformers(distributed, grid, layout, packed):
    results = distributed.run(run_mamba2_models, *grid, layout, packed, MODELS, world_size=4,
                              timeout=600)  # fmt: skip
    failures = []
    for rank, per_model in enumerate(results):
        assert len(per_model) == len(MODELS)
        for model, (errors, swapped, mixers, refused_before) in per_model.items():
            assert swapped >= 1 and mixers == swapped and refused_before, model
            failures += [f"{model} r{rank} {n}: {e:.3g}" for n, e in errors.items()
                         if not e < TOL]  # fmt: skip
    assert not failures, "\n".join(failures)

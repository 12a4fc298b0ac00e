"""A transformers Qwen3.5 (and Qwen3-Next) model under SP through the HF plug-in, its Gated DeltaNet layers
computed by usp (``usp.models.hf.swap_linear_attention``): logits and every parameter
gradient on 4 gloo ranks (u2 x r2; dense zigzag, packed contiguous) against transformers
in one process (document by document when packed: its torch path has no documents).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from hybrid_cases import HYBRID, build
from reference import relative_error
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.24")

import usp  # noqa: E402
from usp.linear import GatedDeltaNet  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shard_batch  # noqa: E402
from usp.models.hf_mixers import TokenMixerError, mixer_problem  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

TOL = 1e-4  # float32, transformers' order of operations against usp's


def _reference(model_type, ids, dlogits, bounds):
    model = build(model_type, HYBRID[model_type])
    logits = []
    for a, b in zip(bounds, bounds[1:]):  # one document at a time
        logits.append(model(input_ids=ids[:, a:b], use_cache=False).logits)
    logits = torch.cat(logits, dim=1)
    (logits * dlogits).sum().backward()
    return model, logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def run_swapped(layout: str, packed: bool, model_type: str = "qwen3_5_text"):
    plan = usp.Plan(topology(2, 2), layout=layout)
    name = usp_hf.register(plan, name=f"usp_gdn_{layout}")
    gen = torch.Generator().manual_seed(5)
    if packed:
        cu = usp.pad_documents(torch.tensor([0, 7, 20], dtype=torch.int32), plan.topology,
                               layout=layout).cu_seqlens  # fmt: skip
        seq = int(cu[-1])
    else:
        cu, seq = None, 16
    ids = torch.randint(0, 64, (1, seq), generator=gen)
    dlogits = torch.randn(1, seq, 64, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, expected, expected_grads = _reference(
            model_type, ids, dlogits, cu.tolist() if packed else [0, seq]
        )
        model = build(model_type, HYBRID[model_type], attn_implementation=name)
        model.load_state_dict(reference.state_dict())
        refused_before = mixer_problem(model, plan)
        swapped = usp_hf.swap_linear_attention(model, plan)
        usp_hf.register(plan, name=name, model=model)  # accepted now: checks this model
        batch = shard_batch(plan, ids, cu_seqlens=cu)
        local = model(**batch.hf_kwargs()).logits  # [1, S/P, V]
        local.backward(plan.shard(dlogits, packed=cu))
    for p in model.parameters():  # replicated weights: the sum over the SP ranks
        dist.all_reduce(p.grad, group=plan.sp_group)
    errors = {"logits": relative_error(plan.gather(local.detach(), packed=cu), expected)}
    for n, p in model.named_parameters():
        errors[n] = relative_error(p.grad, expected_grads[n])
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, GatedDeltaNet)})
    return errors, swapped, kinds, refused_before is not None


def test_qwen3_5_gdn_layers_under_sp_match_transformers(distributed):
    failures = []
    cases = [("zigzag", False, "qwen3_5_text"), ("contiguous", True, "qwen3_5_text"),
             ("zigzag", True, "qwen3_next")]  # fmt: skip
    for layout, packed, model_type in cases:
        results = distributed.run(
            run_swapped, layout, packed, model_type, world_size=4, timeout=300
        )
        kind = "GatedDeltaNetQkvz" if model_type == "qwen3_next" else "GatedDeltaNet"
        for rank, (errors, swapped, kinds, refused_before) in enumerate(results):
            assert swapped == 1 and kinds == [kind] and refused_before
            failures += [
                f"{model_type} {layout} r{rank} {n}: {e:.3g}"
                for n, e in errors.items()
                if not e < TOL
            ]
    assert not failures, "\n".join(failures)


def test_unswapped_qwen3_5_is_still_refused():
    plan = usp.Plan(None)
    model = build("qwen3_5_text", HYBRID["qwen3_5_text"])
    assert mixer_problem(model, plan) is None  # one process: nothing to refuse

    class TwoRanks:  # the checker reads the degrees only
        sp_degree, ulysses_degree, ring_degree = 2, 1, 2

    assert "Qwen3_5GatedDeltaNet" in mixer_problem(model, TwoRanks())
    usp_hf.swap_linear_attention(model, None)
    assert mixer_problem(model, TwoRanks()) is None
    with pytest.raises(TokenMixerError):  # another hybrid is refused as before
        usp_hf.check_model(build("bamba", HYBRID["bamba"]), TwoRanks())


def test_qwen3_5_moe_swap_keeps_the_logits_in_one_process():
    from hybrid_cases import COMMON

    settings = {**HYBRID["qwen3_5_text"], "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}  # fmt: skip
    config = transformers.AutoConfig.for_model("qwen3_5_moe_text", **{**COMMON, **settings})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model(input_ids=ids, use_cache=False).logits
        assert usp_hf.swap_linear_attention(model, None) == 1
        got = model(input_ids=ids, use_cache=False).logits
    assert relative_error(got, expected) < 1e-5

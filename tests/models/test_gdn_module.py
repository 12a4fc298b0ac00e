"""usp.linear.GatedDeltaNet against transformers' Qwen3_5GatedDeltaNet (issue 45): the same
state dict, the same forward and gradients in one process (float32; float64 within
transformers' float32 internals), and on 4 gloo ranks (u2 x r2, zigzag dense and
contiguous packed) against transformers run document by document in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hybrid_cases import COMMON, HYBRID
from reference import relative_error
from usp_cases import topology

import usp
from usp.linear.module import GatedDeltaNet

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
transformers = pytest.importorskip("transformers")


def _config():
    return transformers.Qwen3_5TextConfig(**COMMON, **HYBRID["qwen3_5_text"])


def _pair(dtype, seed=0):
    config = _config()
    torch.manual_seed(seed)
    theirs = hf.Qwen3_5GatedDeltaNet(config, 0).to(dtype)
    with torch.no_grad():  # non-trivial norm and bias values
        theirs.norm.weight.uniform_(0.5, 1.5)
        theirs.dt_bias.uniform_(-1, 1)
    mine = GatedDeltaNet.from_config(config, chunk_size=5).to(dtype)
    mine.load_state_dict(theirs.state_dict())
    return theirs, mine


def _forward_backward(module, x, dout, **kwargs):
    x = x.clone().requires_grad_()
    out = module(x, **kwargs)
    out.backward(dout)
    grads = {name: p.grad for name, p in module.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 2e-5)])
def test_module_matches_transformers_in_one_process(dtype, tol):
    theirs, mine = _pair(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, 32, generator=gen).to(dtype)
    dout = torch.randn(2, 37, 32, generator=gen).to(dtype)
    expected = _forward_backward(theirs, x, dout)
    actual = _forward_backward(mine, x, dout)
    assert relative_error(actual[0], expected[0]) < tol
    assert relative_error(actual[1], expected[1]) < tol
    assert expected[2].keys() == actual[2].keys()
    for name, grad in expected[2].items():
        assert relative_error(actual[2][name], grad) < tol, name


def test_module_refuses_cache_and_padding():
    _, mine = _pair(torch.float32)
    x = torch.randn(1, 8, 32)
    with pytest.raises(ValueError, match="use_cache=False"):
        mine(x, cache=object())
    with pytest.raises(ValueError, match="padding"):
        mine(x, attention_mask=torch.tensor([[1] * 7 + [0]]))


def run_module_under_sp(layout, packed):
    topo = topology(2, 2)
    plan = usp.Plan(topo, layout=layout)
    theirs, mine = _pair(torch.float64, seed=2)
    if packed:
        raw = torch.tensor([0, 9, 10, 30], dtype=torch.int32)
        cu = usp.pad_documents(raw, topo, layout=layout).cu_seqlens
        batch, seq_len = 1, int(cu[-1])
    else:
        cu, batch, seq_len = None, 2, 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, seq_len, 32, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, seq_len, 32, generator=gen, dtype=torch.float64)

    # transformers, document by document (its torch path has no documents)
    bounds = [0, seq_len] if cu is None else cu.tolist()
    outs, x_grads = [], []
    for a, b in zip(bounds, bounds[1:]):
        out, x_grad, _ = _forward_backward(theirs, x[:, a:b], dout[:, a:b])
        outs.append(out)
        x_grads.append(x_grad)
    expected = [torch.cat(outs, 1), torch.cat(x_grads, 1)]
    expected_params = {n: p.grad for n, p in theirs.named_parameters()}
    # usp's module in one process (no ring, no all-to-all): what the SP run must equal
    single = GatedDeltaNet.from_config(_config(), chunk_size=7).double()
    single.load_state_dict(mine.state_dict())
    single_out, single_dx, single_params = _forward_backward(single, x, dout, packed=cu)

    mine.plan = plan if packed else None  # the module's plan, or the forward's
    local_x = plan.shard(x, packed=cu).requires_grad_()
    out = mine(local_x, plan=None if packed else plan, packed=cu)
    out.backward(plan.shard(dout, packed=cu))
    for p in mine.parameters():  # replicated weights: the sum over the SP ranks
        dist.all_reduce(p.grad, group=topo.sp_group)
    actual = [plan.gather(out.detach(), packed=cu), plan.gather(local_x.grad, packed=cu)]
    vs_hf = {n: relative_error(a, e) for n, a, e in zip(("out", "dx"), actual, expected)}
    exact = {
        n: relative_error(a, e) for n, a, e in zip(("out", "dx"), actual, (single_out, single_dx))
    }
    for name, p in mine.named_parameters():
        vs_hf[name] = relative_error(p.grad, expected_params[name])
        exact[name] = relative_error(p.grad, single_params[name])
    return vs_hf, exact, run_bfloat16_under_sp(plan, theirs.state_dict())


def run_bfloat16_under_sp(plan, state):
    """bfloat16 weights and activations (the decay and beta in float32 travel in their own
    all-to-all): the SP run against the one-process module, both bfloat16."""
    modules = []
    for _ in range(2):
        module = GatedDeltaNet.from_config(_config())
        module.load_state_dict(state)
        modules.append(module.to(torch.bfloat16))
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    expected = modules[0](x)
    actual = plan.gather(modules[1](plan.shard(x), plan=plan).detach())
    assert actual.dtype == torch.bfloat16
    return relative_error(actual.double(), expected.detach().double())


def test_module_under_sp_matches_transformers_document_by_document(distributed):
    failures = []
    for layout, packed in (("zigzag", False), ("contiguous", True)):
        results = distributed.run(run_module_under_sp, layout, packed, world_size=4, timeout=120)
        for rank, (vs_hf, exact, bf16) in enumerate(results):
            if not bf16 < 2e-2:
                failures.append(f"{layout} {packed} r{rank} bfloat16 {bf16:.3g}")
            failures += [
                f"{layout} {packed} r{rank} {n} vs hf {e:.3g}"
                for n, e in vs_hf.items()
                if not e < 2e-5
            ]
            failures += [
                f"{layout} {packed} r{rank} {n} vs 1 process {e:.3g}"
                for n, e in exact.items()
                if not e < 1e-10
            ]
    assert not failures, "\n".join(failures)


def test_module_options_match_transformers():
    """A kernel of 2, another epsilon, the module's own plan (None) and chunk size."""
    config = transformers.Qwen3_5TextConfig(
        **{**COMMON, **HYBRID["qwen3_5_text"], "linear_conv_kernel_dim": 2, "rms_norm_eps": 1e-3}
    )
    torch.manual_seed(6)
    theirs = hf.Qwen3_5GatedDeltaNet(config, 0)
    mine = GatedDeltaNet(32, 2, 4, 8, 8, conv_kernel_size=2, rms_norm_eps=1e-3,
                         activation="silu", plan=None, chunk_size=3)  # fmt: skip
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 11, 32)
    assert relative_error(mine(x), theirs(x)) < 2e-5

"""fla's real Triton kernels through usp's mappings, on CPU under Triton's interpreter
(issue 57 item 4; ``tests/helpers/fla_interpreter.py``): ``gated_deltanet_usp`` and
``mamba2_usp`` with ``kernel="fla"`` on u1 x r2 (2 gloo ranks, packed documents: the
ring's [0 | I] start states reach fla's initial states) against ``kernel="torch"``,
output and every gradient within 1e-4 relative; the kernels' self-checks run first, as
before any first use. Interpreted Triton is slow: the smallest shapes that exercise the
mapping (two documents, two heads, dims of 16)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gdn_cases import gdn_inputs
from mamba_cases import mamba_inputs
from reference import relative_error
from usp_cases import topology

import usp
from usp.linear import gated_deltanet_usp
from usp.linear.mamba2 import mamba2_usp

# looked up, not imported: fla must first be imported under the interpreter (in the ranks)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
    reason="needs fla-core and triton (the dev extra)",
)

TOL = 1e-4


def _both_kernels(call, inputs, plan, cu, dout):
    """call(*local inputs, kernel=...) with fla and with torch: the relative errors of the
    output and of every input's gradient, and whether fla really ran (not a fallback)."""
    results = []
    for kernel in ("fla", "torch"):
        local = [plan.shard(t, packed=cu).requires_grad_() if t.dim() > 1 and t.shape[1] ==
                 dout.shape[1] else t.clone().requires_grad_() for t in inputs]  # fmt: skip
        out = call(*local, kernel=kernel)
        out.backward(plan.shard(dout, packed=cu))
        results.append([out.detach(), *(t.grad for t in local)])
    return [relative_error(a, e) for a, e in zip(*results)]


def run_fla_interpreted():
    plan = usp.Plan(topology(1, 2), layout="zigzag")
    cu = usp.pad_documents(torch.tensor([0, 5, 11], dtype=torch.int32), plan.topology,
                           layout="zigzag").cu_seqlens  # fmt: skip
    seq = int(cu[-1])
    errors = {}
    # fla is imported in here, under the interpreter (fla_interpreter.interpreted_ranks)
    inputs, ws, dout = gdn_inputs(1, seq, 1, 2, 16, 16, 4, seed=3, dtype=torch.float32)

    def gdn(q, k, v, g, beta, *weights, kernel):
        return gated_deltanet_usp(q, k, v, g, beta, plan, conv_weights=weights, packed=cu,
                                  chunk_size=16, kernel=kernel, conv_kernel="torch")  # fmt: skip

    errors["gdn"] = _both_kernels(gdn, inputs + ws, plan, cu, dout)
    m_inputs, m_dout = mamba_inputs(1, seq, 2, 1, 16, 16, 4, seed=4, dtype=torch.float32)

    def mamba(x, b, c, dt, a, d, weight, bias, *, kernel):
        return mamba2_usp(x, b, c, dt, a, plan, d=d, conv_weight=weight, conv_bias=bias,
                          packed=cu, chunk_size=16, kernel=kernel, conv_kernel="torch")  # fmt: skip

    errors["mamba2"] = _both_kernels(mamba, m_inputs, plan, cu, m_dout)
    return errors, seq


def test_fla_kernels_through_usp_equal_the_torch_kernels():
    from fla_interpreter import interpreted_ranks

    with interpreted_ranks(2) as ranks:
        results = ranks.run(run_fla_interpreted, timeout=1500)
    for rank, (errors, seq) in enumerate(results):
        assert seq == 16, seq  # two documents padded for 2 x 2 zigzag chunks
        for mixer, errs in errors.items():
            assert all(e < TOL for e in errs), (rank, mixer, errs)

"""A Gated DeltaNet layer under ``torch.compile(fullgraph=True)`` (issue 45 item 4): the
ring block's op (``usp::gdn_ring_block``, usp/linear/compiled.py) passes torch's op
checks, and the compiled layer equals eager in float64, forward and every gradient, in
one process: packed documents (three packings with different document counts, one
graph: a recompile is an error) and a dense batch. The 4-rank case (u2 x r2, the ring's
state pass compiled) is in tests/attention/test_gdn_usp.py; qwen3.5 training compiled
in tests/train/test_train_compile.py.

``backend="aot_eager"`` builds the forward and backward graphs without Inductor's code
generation (minutes on two busy cores); Inductor runs in the training test.
"""

from __future__ import annotations

import pytest
import torch
from gdn_cases import gdn_inputs
from reference import relative_error

import usp
from usp.linear.compiled import gdn_ring_block
from usp.linear.module import GatedDeltaNet

TOL = 1e-12
#: three packings of 48 tokens (3, 4 and 5 documents; some shorter than the conv)
PACKINGS = ([0, 5, 17, 48], [0, 20, 21, 30, 48], [0, 1, 2, 3, 40, 48])


def test_the_op_passes_torch_op_checks():
    (q, k, v, g, beta), ws, _ = gdn_inputs(1, 23, 2, 4, 8, 6, 4, seed=1)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, *ws)]
    bounds = torch.tensor([0, 1, 3, 12, 23], dtype=torch.int32)
    args = (*leaves[:5], leaves[5:], bounds, 23, "contiguous", "", 0, 1, 1, "silu", 0.3, True,
            4, "torch", "torch")  # fmt: skip
    torch.library.opcheck(
        gdn_ring_block, args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )  # fmt: skip


def _run(forward, layer, x, dout, packed):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = forward(x, packed=packed)
    out.backward(dout)
    return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def test_compiled_layer_equals_eager_over_new_packings():
    import torch._dynamo
    from torch._dynamo.utils import counters

    plan = usp.Plan(None)
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 6, 4, plan=plan, chunk_size=4).double()
    with torch.no_grad():  # non-trivial norm and bias values
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.uniform_(-1, 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 48, 32, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, 48, 32, generator=gen, dtype=torch.float64)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    for index, cu in enumerate(PACKINGS):
        packed = plan.pack(torch.tensor(cu, dtype=torch.int32))
        expected = _run(layer.forward, layer, x, dout, packed)
        # the first packing compiles; the others reuse its graph (a recompile: an error)
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            actual = _run(compiled, layer, x, dout, packed)
        errors = [relative_error(a, e) for a, e in zip(actual, expected)]
        assert max(errors) < TOL, (cu, errors)
    assert counters["stats"]["unique_graphs"] == 1
    # a dense batch of two rows: its own graph (no boundaries)
    x2 = torch.randn(2, 24, 32, generator=gen, dtype=torch.float64)
    dout2 = torch.randn(2, 24, 32, generator=gen, dtype=torch.float64)
    expected = _run(layer.forward, layer, x2, dout2, None)
    actual = _run(compiled, layer, x2, dout2, None)
    errors = [relative_error(a, e) for a, e in zip(actual, expected)]
    assert max(errors) < TOL, errors
    assert counters["stats"]["unique_graphs"] == 2
    assert sum(counters["graph_break"].values()) == 0


def test_compiled_call_refuses_raw_boundaries():
    """Raw cu_seqlens would be read on the host inside the graph: refused while tracing
    with the fix (Dynamo re-raises the check's error with its message)."""
    from usp.linear import gated_deltanet_usp

    inputs, ws, _ = gdn_inputs(1, 12, 2, 4, 8, 6, 4, seed=2)
    compiled = torch.compile(gated_deltanet_usp, fullgraph=True, backend="aot_eager")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"LinearAttentionError: .*PackedSequence .*plan.pack"):
        compiled(*inputs, None, conv_weights=ws, packed=cu)

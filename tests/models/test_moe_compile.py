"""``torch.compile`` on the mixture-of-experts families (usp.models.moe_op).

The op ``usp::moe_experts`` (the experts' data-dependent part, opaque to Dynamo) against
the eager experts it wraps, for both expert kinds (Qwen3-MoE's SwiGLU, gpt-oss's biases
and clamped SwiGLU), on the per-expert segments (float64) and torch's grouped GEMM
(float32 on the CPU), with an expert no token chose: output and every gradient through
its registered autograd (a backward op recomputing the experts). torch's own op checks
(schema, autograd registration, fake implementation).

Then whole models: the tiny Qwen3-MoE and gpt-oss presets (float32, dense rows, the
load-balancing loss on) with each decoder layer compiled as ``[train] compile`` compiles
it (``compile_layers``: fullgraph, Inductor), against the same weights eagerly: loss, the
aux term the model returns and every gradient. Inductor fuses float32 arithmetic: 1e-5
relative (observed: about 1e-7). The 4-rank compiled training runs are in
tests/train/test_train_compile.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_cases import grad_errors, relative_error

from usp.models.gpt_oss import GptOss, GptOssExperts
from usp.models.moe import Experts, grouped_gemm_available
from usp.models.moe_op import moe_experts, routed_experts
from usp.models.qwen3_moe import Qwen3Moe
from usp.train.parallelize import compile_layers


def _experts(kind: str, dtype: torch.dtype) -> Experts:
    torch.manual_seed(0)
    if kind == "swiglu":
        experts = Experts(6, 12, 8, 3)
    else:  # alpha 1.702 and a limit that binds on these weights
        experts = GptOssExperts(6, 12, 8, 3, alpha=1.702, limit=0.5)
    experts = experts.to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    return experts


def _routing(tokens: int, dtype: torch.dtype):
    """top-3 of 6 experts that never picks expert 2."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(tokens, 6, generator=gen, dtype=torch.float64)
    scores[:, 2] = -1
    weights, experts = scores.topk(3, dim=-1)
    return experts, weights.to(dtype)


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_op_equals_the_eager_experts(kind, dtype):
    grouped = grouped_gemm_available(dtype, torch.device("cpu"))
    assert grouped == (dtype == torch.float32)  # both paths are covered
    experts = _experts(kind, dtype)
    idx, weights = _routing(10, dtype)
    x = torch.randn(10, 12, dtype=dtype)
    results = []
    for run in (routed_experts, moe_experts):
        leaves = [
            t.detach().clone().requires_grad_(True) for t in (x, weights, *experts.op_params())
        ]
        out = run(leaves[0], idx, leaves[1], leaves[2:], experts.kind, experts.op_options(),
                  grouped)  # fmt: skip
        probe = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
        (out * probe).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    eager, op = results
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    for a, b in zip(op, eager):
        assert a.shape == b.shape and relative_error(a, b) <= tol
    assert op[3].abs().sum() > 0 and op[3][2].abs().max() == 0  # expert 2: no token, zero
    params = [p.detach().requires_grad_(True) for p in experts.op_params()]
    args = (x.requires_grad_(True), idx, weights, params, experts.kind, experts.op_options(),
            grouped)  # fmt: skip
    torch.library.opcheck(
        moe_experts, args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )  # fmt: skip


def _loss_aux_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss, aux = model(ids, labels=labels, return_aux_loss=True)
    loss.backward()
    return loss.item(), aux.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", [Qwen3Moe, GptOss])
def test_compiled_layers_equal_eager(family):
    """Dense rows (2 x 32; gpt-oss's window of 16 and its sinks act)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    preset = "qwen3-moe-tiny" if family is Qwen3Moe else "gpt-oss-tiny"
    torch.manual_seed(3)
    eager = family.from_config(preset, backend="math")
    assert eager.adds_aux_loss
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_layers(compiled)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (2, 32), generator=gen)
    labels = torch.randint(0, 256, (2, 32), generator=gen)
    expected = _loss_aux_grads(eager, ids, labels)
    loss, aux, grads = _loss_aux_grads(compiled, ids, labels)
    assert counters["stats"]["unique_graphs"] > 0
    assert sum(counters["graph_break"].values()) == 0  # each layer whole (fullgraph)
    assert abs(loss - expected[0]) <= 1e-5 * expected[0], (loss, expected[0])
    assert abs(aux - expected[1]) <= 1e-5 * expected[1], (aux, expected[1])
    assert set(grads) == set(expected[2])
    assert max(grad_errors(grads, expected[2]).values()) <= 1e-5
    router = "router.weight" if family is GptOss else "gate.weight"
    assert any(n.endswith(router) and g.abs().max() > 0 for n, g in grads.items())

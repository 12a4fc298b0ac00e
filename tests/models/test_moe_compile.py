"""``torch.compile`` on the mixture-of-experts families (usp.models.moe_op).

The op ``usp::moe_experts`` (the experts' data-dependent part, opaque to Dynamo) against
the eager experts it wraps, for both expert kinds (Qwen3-MoE's SwiGLU, gpt-oss's biases
and clamped SwiGLU), on the per-expert segments (float64) and torch's grouped GEMM
(float32 on the CPU), with an expert no token chose: output and every gradient through
its registered autograd (a backward op recomputing the experts). torch's own op checks
(schema, autograd registration, fake implementation).

Then whole models: the tiny Qwen3-MoE, gpt-oss and Qwen3.5-MoE presets (dense rows, the
load-balancing loss on; Qwen3.5-MoE's Gated DeltaNet layers through their ring block's
op, usp.linear.compiled) with each decoder layer compiled as ``[train] compile`` compiles
it (``compile_layers``: fullgraph), against the same weights eagerly: loss, the aux term
the model returns and every gradient. The graphs are Dynamo's and AOT autograd's, run
without Inductor's code generation (``backend="aot_eager"``: what is asserted here is
the trace, the op's place and autograd formula in it and the aux term's way out, not
Inductor's kernels); Qwen3-MoE and gpt-oss in float32 (the op's grouped GEMM path),
1e-5 relative. Inductor compiles these layers in tests/train/test_train_compile.py:
Qwen3-MoE's sparse layer trained on 2 ranks (ring 2, packed), gpt-oss's layers trained
in one process (packed), both against eager. (Both ran through Inductor here too until
2026-12-07: about 55 s of a cold-cache suite for the same layers.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_cases import grad_errors, relative_error

from usp.models.gpt_oss import GptOss
from usp.models.gpt_oss_experts import GptOssExperts
from usp.models.moe import Experts, grouped_gemm_available
from usp.models.moe_op import moe_experts, routed_experts
from usp.models.qwen3_5_moe import Qwen3_5Moe
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
        args = (leaves[0], idx, leaves[1], leaves[2:], experts.kind, experts.op_options(),
                grouped)  # fmt: skip
        out = run(*args) if run is routed_experts else run(*args, 0)  # (the op: no tiles)
        probe = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
        (out * probe).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    eager, op = results
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    for a, b in zip(op, eager):
        assert a.shape == b.shape and relative_error(a, b) <= tol
    assert op[3].abs().sum() > 0 and op[3][2].abs().max() == 0  # expert 2: no token, zero
    params = [p.detach().requires_grad_(True) for p in experts.op_params()]
    args = (
        x.requires_grad_(True),
        idx,
        weights,
        params,
        experts.kind,
        experts.op_options(),
        grouped,
        3,
    )  # fmt: skip  (tiles of 3 tokens)
    torch.library.opcheck(
        moe_experts, args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )  # fmt: skip


def _loss_aux_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss, aux = model(ids, labels=labels, return_aux_loss=True)
    loss.backward()
    return loss.item(), aux.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


#: family -> (preset, dtype, tolerance). Qwen3.5-MoE in float64 (Inductor compiles its
#: GDN layers in test_train_compile): its decay parameters' gradients are sums with heavy
#: cancellation (A_log's entries 1e-9 to 1e-5), which float32 reordering moved by up to
#: 7e-4 relative (observed)
CASES = {
    Qwen3Moe: ("qwen3-moe-tiny", torch.float32, 1e-5),
    GptOss: ("gpt-oss-tiny", torch.float32, 1e-5),
    Qwen3_5Moe: ("qwen3.5-moe-tiny", torch.float64, 1e-10),
}


@pytest.mark.parametrize("family", list(CASES), ids=[c[0] for c in CASES.values()])
def test_compiled_layers_equal_eager(family):
    """Dense rows (2 x 32; gpt-oss's window of 16 and its sinks act)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    preset, dtype, tol = CASES[family]
    torch.manual_seed(3)
    eager = family.from_config(preset, backend="math").to(dtype)
    assert eager.adds_aux_loss
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_layers(compiled, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (2, 32), generator=gen)
    labels = torch.randint(0, 256, (2, 32), generator=gen)
    expected = _loss_aux_grads(eager, ids, labels)
    loss, aux, grads = _loss_aux_grads(compiled, ids, labels)
    assert counters["stats"]["unique_graphs"] > 0
    assert sum(counters["graph_break"].values()) == 0  # each layer whole (fullgraph)
    assert abs(loss - expected[0]) <= tol * expected[0], (loss, expected[0])
    assert abs(aux - expected[1]) <= tol * expected[1], (aux, expected[1])
    assert set(grads) == set(expected[2])
    assert max(grad_errors(grads, expected[2]).values()) <= tol
    router = "router.weight" if family is GptOss else "gate.weight"
    assert any(n.endswith(router) and g.abs().max() > 0 for n, g in grads.items())

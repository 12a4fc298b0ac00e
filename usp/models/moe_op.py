"""The experts' data-dependent part as one ``torch.library`` op, for ``torch.compile``.

:class:`usp.models.moe.Experts` sorts the (token, expert) pairs by expert and runs each
expert on its segment of rows: the segment sizes depend on the routing (a host sync
for the per-expert loop, offsets for the grouped GEMM), which Dynamo cannot trace into
a static graph. Under compilation that whole part is one opaque op with fixed shapes:

    usp::moe_experts(x [N, H], experts [N, k] int64, weights [N, k], params, kind,
                     options, grouped) -> [N, H]

each token's weighted sum of its experts' outputs. ``params`` are the experts' grouped
weights (their order is the kind's), ``kind`` names the expert function registered with
:func:`register_experts_kind` (``"swiglu"``: Qwen3-MoE's; ``"gpt_oss"``: biases and the
clamped SwiGLU), ``options`` its float settings, ``grouped`` whether it may use
``torch._grouped_mm``. Its fake implementation gives the shape; its autograd formula
calls ``usp::moe_experts_backward``, which recomputes the experts' forward on the saved
inputs under autograd and returns the gradients of ``x``, ``weights`` and every param:
the same operations eager autograd differentiates, so compiled and eager gradients are
computed alike (the recompute costs the experts' forward once more in backward, as an
activation checkpoint of the experts would; only the experts, not the router).

Eager runs never call the op (:meth:`usp.models.moe.Experts.forward` switches on
``torch.compiler.is_compiling()``): there autograd records the experts directly and
nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from usp.kernels.recompute import autograd_dispatch
from usp.models.moe_planning import hold_gradients, opened_by, planned, planned_routing

Tensor = torch.Tensor
#: kind -> fn(rows [M, H] sorted by expert, counts [E], row_experts [M], params, options,
#: grouped) -> [M, H]: every expert on its segment
_KINDS: dict[str, Callable] = {}


def register_experts_kind(name: str, run_sorted: Callable) -> None:
    """Make ``run_sorted`` (see ``_KINDS``) the expert function ``kind=name`` runs."""
    _KINDS[name] = run_sorted


def routed_experts(
    x: Tensor,
    experts: Tensor,
    weights: Tensor,
    params: Sequence[Tensor],
    kind: str,
    options: Sequence[float],
    grouped: bool,
) -> Tensor:
    """x [N, H], experts [N, k], weights [N, k] -> [N, H]: sort the (token, expert) pairs
    by expert, gather the routed rows, run every expert on its contiguous segment, add
    the weighted rows back per token (eagerly differentiable: the op's implementation
    and the eager path are this one function)."""
    k = experts.shape[-1]
    num_experts = params[0].shape[0]
    flat = experts.reshape(-1)  # [N*k], token t's j-th expert at t*k + j
    order = flat.argsort(stable=True)  # the (token, expert) pairs sorted by expert
    tokens = order // k  # [N*k]: the token of each sorted row
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] rows per expert
    rows = x.index_select(0, tokens)  # [N*k, H], grouped by expert
    run = _KINDS[kind]
    row_experts = flat.index_select(0, order)
    if planned(x):  # usp plan: the most uneven routing and a hold for the gradients
        hold, params = hold_gradients(params, k)  # (usp.models.moe_planning)
        with planned_routing(k):
            hidden = opened_by(run(rows, counts, row_experts, params, options, grouped), hold)
    else:
        hidden = run(rows, counts, row_experts, params, options, grouped)
    hidden = hidden * weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [N*k, H]
    return torch.zeros_like(x).index_add_(0, tokens, hidden)  # [N, H]


@torch.library.custom_op("usp::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    experts: Tensor,
    weights: Tensor,
    params: list[Tensor],
    kind: str,
    options: list[float],
    grouped: bool,
) -> Tensor:
    """See the module docstring."""
    return routed_experts(x, experts, weights, params, kind, options, grouped)


@moe_experts.register_fake
def _moe_experts_fake(x, experts, weights, params, kind, options, grouped):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("usp::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad: Tensor,
    x: Tensor,
    experts: Tensor,
    weights: Tensor,
    params: list[Tensor],
    kind: str,
    options: list[float],
    grouped: bool,
) -> list[Tensor]:
    """The gradients of ``x``, ``weights`` and every param for the output's ``grad``
    (zeros where the output does not depend on one, e.g. an expert no token chose)."""
    leaves = [t.detach().requires_grad_(True) for t in (x, weights, *params)]
    with autograd_dispatch(), torch.enable_grad():
        out = routed_experts(leaves[0], experts, leaves[1], leaves[2:], kind, options, grouped)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad, x, experts, weights, params, kind, options, grouped):
    return [torch.empty_like(t) for t in (x, weights, *params)]


def _setup_context(ctx, inputs, output) -> None:
    x, experts, weights, params, kind, options, grouped = inputs
    ctx.save_for_backward(x, experts, weights, *params)
    ctx.settings = (kind, options, grouped)


def _backward(ctx, grad):
    x, experts, weights, *params = ctx.saved_tensors
    kind, options, grouped = ctx.settings
    dx, dweights, *dparams = moe_experts_backward(
        grad.contiguous(), x, experts, weights, params, kind, options, grouped
    )
    # (the autograd wrapper takes a list of floats as one input, an empty one as a list)
    no_grad_options = None if options else []
    return dx, None, dweights, dparams, None, no_grad_options, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)

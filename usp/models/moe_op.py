"""The experts' data-dependent part as one ``torch.library`` op, for ``torch.compile``.

:class:`usp.models.moe.Experts` sorts the (token, expert) pairs by expert and runs each
expert on its segment of rows: the segment sizes depend on the routing (a host sync
for the per-expert loop, offsets for the grouped GEMM), which Dynamo cannot trace into
a static graph. Under compilation that whole part is one opaque op with fixed shapes:

    usp::moe_experts(x [N, H], experts [N, k] int64, weights [N, k], params, kind,
                     options, grouped, tile) -> [N, H]

each token's weighted sum of its experts' outputs. ``params`` are the experts' grouped
weights (their order is the kind's), ``kind`` names the expert function registered with
:func:`register_experts_kind` (``"swiglu"``: Qwen3-MoE's; ``"gpt_oss"``: biases and the
clamped SwiGLU), ``options`` its float settings, ``grouped`` whether it may use
``torch._grouped_mm``, ``tile`` the tokens per tile (0: all at once). Its fake
implementation gives the shape; its autograd formula calls ``usp::moe_experts_backward``,
which recomputes the experts' forward on the saved inputs under autograd and returns
the gradients of ``x``, ``weights`` and every param: the same operations eager autograd
differentiates, so compiled and eager gradients are computed alike (the recompute costs
the experts' forward once more in backward, as an activation checkpoint of the experts
would; only the experts, not the router).

**Tiles of routed rows** (``mlp_tile_tokens``, :func:`tiled_experts`): the tokens run
``tile`` at a time (``tile * k`` routed rows), so the experts' ``[rows, 2I]`` work
tensors exist for one tile; nothing but the inputs is kept for backward, which
recomputes each tile under autograd (:func:`experts_backward`). Memory-periodic
(:mod:`usp.models.tiling`: the output and every gradient allocated before the loop,
each tile's work freed with it), so ``usp plan`` runs the first and the last tile only.
Each token's output is computed by the untiled formulas; the parameters' gradients are
sums over tiles.

Eager runs without tiles never call the op (:meth:`usp.models.moe.Experts.forward`
switches on ``torch.compiler.is_compiling()``): there autograd records the experts
directly and nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from usp.kernels.recompute import autograd_dispatch
from usp.models.moe_planning import hold_gradients, opened_by, planned, planned_routing
from usp.models.tiling import representative, tiles

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


def experts_forward(x, experts, weights, params, kind, options, grouped, tile) -> Tensor:
    """:func:`routed_experts` over tiles of ``tile`` tokens (0: one pass), each tile's
    output written into one ``[N, H]`` tensor; nothing kept for a backward."""
    if not tile or tile >= x.shape[0]:
        return routed_experts(x, experts, weights, params, kind, options, grouped)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [N, H]
    for rows in tiles(x.shape[0], tile, representative_only=representative(x)):
        out[rows] = routed_experts(
            x[rows], experts[rows], weights[rows], params, kind, options, grouped
        )
    return out


def experts_backward(
    grad, x, experts, weights, params, kind, options, grouped, tile, needs=None
) -> list[Tensor | None]:
    """The gradients of ``x``, ``weights`` and each param for the output's ``grad``, the
    forward recomputed under autograd tile by tile (``tile`` tokens; 0: one pass);
    ``needs``: which of them to compute (None: all; the others are None). Zeros where
    the output does not depend on one (an expert no token chose)."""
    inputs = (x, weights, *params)
    needs = [True] * len(inputs) if needs is None else list(needs)
    rows_all = x.shape[0]
    tile = tile if tile and tile < rows_all else rows_all
    if tile == rows_all:  # one pass: the gradients as autograd makes them
        return _tile_gradients(grad, x, experts, weights, params, kind, options, grouped, needs)
    grads = [
        (torch.zeros_like(t) if i >= 2 else torch.empty_like(t)) if need else None
        for i, (t, need) in enumerate(zip(inputs, needs))
    ]  # allocated before the loop (memory-periodic)
    for rows in tiles(rows_all, tile, representative_only=representative(x)):
        _add_tile(grads, rows, grad, x, experts, weights, params, kind, options, grouped, needs)
    return grads


def _add_tile(grads, rows, grad, x, experts, weights, params, kind, options, grouped, needs):
    """One tile's gradients into ``grads``: its rows of x's and the weights', a sum for
    the parameters'; the tile's own tensors are freed on return (memory-periodic)."""
    part = _tile_gradients(
        grad[rows], x[rows], experts[rows], weights[rows], params, kind, options, grouped, needs
    )
    for index, (total, piece) in enumerate(zip(grads, part)):
        if total is None:
            continue
        if index < 2:  # x and weights: this tile's rows
            total[rows] = piece
        else:  # the parameters: summed over tiles
            total.add_(piece)


def _tile_gradients(grad, x, experts, weights, params, kind, options, grouped, needs):
    leaves = [t.detach().requires_grad_(need) for t, need in zip((x, weights, *params), needs)]
    wanted = [t for t in leaves if t.requires_grad]
    with autograd_dispatch(), torch.enable_grad():
        out = routed_experts(leaves[0], experts, leaves[1], leaves[2:], kind, options, grouped)
        found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
    grads = []
    for t in leaves:
        g = next(found) if t.requires_grad else None
        grads.append(torch.zeros_like(t) if t.requires_grad and g is None else g)
    return grads


class _TiledExperts(torch.autograd.Function):
    """Eager tiles: :func:`experts_forward` and :func:`experts_backward`."""

    @staticmethod
    def forward(ctx, x, experts, weights, kind, options, grouped, tile, *params):
        ctx.save_for_backward(x, experts, weights, *params)
        ctx.settings = (kind, options, grouped, tile)
        return experts_forward(x, experts, weights, params, kind, options, grouped, tile)

    @staticmethod
    def backward(ctx, grad):
        x, experts, weights, *params = ctx.saved_tensors
        kind, options, grouped, tile = ctx.settings
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], *ctx.needs_input_grad[7:])
        dx, dweights, *dparams = experts_backward(
            grad.contiguous(), x, experts, weights, params, kind, options, grouped, tile, needs
        )
        return dx, None, dweights, None, None, None, None, *dparams


def tiled_experts(x, experts, weights, params, kind, options, grouped, tile) -> Tensor:
    """x [N, H], experts [N, k], weights [N, k] -> [N, H] as :func:`routed_experts`, over
    tiles of ``tile`` tokens, each recomputed in backward (see the module docstring)."""
    return _TiledExperts.apply(x, experts, weights, kind, options, grouped, tile, *params)


@torch.library.custom_op("usp::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    experts: Tensor,
    weights: Tensor,
    params: list[Tensor],
    kind: str,
    options: list[float],
    grouped: bool,
    tile: int,
) -> Tensor:
    """See the module docstring."""
    return experts_forward(x, experts, weights, params, kind, options, grouped, tile)


@moe_experts.register_fake
def _moe_experts_fake(x, experts, weights, params, kind, options, grouped, tile):
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
    tile: int,
) -> list[Tensor]:
    """The gradients of ``x``, ``weights`` and every param for the output's ``grad``
    (:func:`experts_backward`)."""
    return experts_backward(grad, x, experts, weights, params, kind, options, grouped, tile)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad, x, experts, weights, params, kind, options, grouped, tile):
    return [torch.empty_like(t) for t in (x, weights, *params)]


def _setup_context(ctx, inputs, output) -> None:
    x, experts, weights, params, kind, options, grouped, tile = inputs
    ctx.save_for_backward(x, experts, weights, *params)
    ctx.settings = (kind, options, grouped, tile)


def _backward(ctx, grad):
    x, experts, weights, *params = ctx.saved_tensors
    kind, options, grouped, tile = ctx.settings
    dx, dweights, *dparams = moe_experts_backward(
        grad.contiguous(), x, experts, weights, params, kind, options, grouped, tile
    )
    # (the autograd wrapper takes a list of floats as one input, an empty one as a list)
    no_grad_options = None if options else []
    return dx, None, dweights, dparams, None, no_grad_options, None, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)

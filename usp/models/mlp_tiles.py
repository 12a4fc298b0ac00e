"""The tiled gated MLP (SwiGLU, GeGLU) as one autograd function with a hand-written
backward.

    out = down(act(gate(x)) * up(x)),   gate(x) = x @ w_gate.T, ...

``act`` SiLU or tanh-approximated GELU (:data:`ACTIVATIONS`). :func:`tiled_glu` runs
forward and backward over tiles of ``tile`` tokens, so the
``[tokens, intermediate]`` activations exist for one tile at a time. It saves ``x``
and the three weights only; backward recomputes each tile's gate and up projections.

**Memory-periodic** (:mod:`usp.models.tiling`), so that ``usp plan`` may run only the
first and the last tile under fake tensors: every tensor that outlives a tile -- the
output, the input gradient, the three weight gradients -- is allocated before the loop
and written in place (``mm(out=...)``, ``addmm_``), and each tile's work tensors are
freed when its function returns. (The per-tile ``torch.utils.checkpoint`` it replaces
grew a list of tile outputs, concatenated them at the end, held every tile's input
gradient in ``SplitBackward`` and made new weight gradients per tile.)

**Exactness.** Every token's output and input gradient is computed by the formulas
autograd uses for the untiled MLP (``mm`` backward, ``mul`` backward, the activation's
derivative by its own backward op, ``aten.silu_backward`` / ``aten.gelu_backward``), row
by row; the input gradient's two terms (through gate and
through up) are added by one ``addmm_`` where autograd adds two rounded products. The
weight gradients are sums over tiles, accumulated in the weight's dtype by ``addmm_``
into buffers allocated before the loop. Autograd through the per-tile checkpoint this
replaced rounded each tile's product to the weight's dtype and added it in that dtype
in ``AccumulateGrad``. Measured on the CPU in bf16 (4 seeds, 15 tiles): the weight
gradients' distance from float64 is that path's to within 25% either way (mostly
equal), both about 2x the untiled MLP's, which rounds one product over all tokens
once; a GEMM that adds the buffer in its float32 accumulator rounds once per tile. A float32 accumulator would double the three
gradient buffers (bf16 Llama-3.1-8B: +336 MiB per layer), so none is kept.
``tests/models/test_mlp_tiles.py`` holds it against untiled autograd in float64
(1e-12), float32 and bf16.

**Low-rank adapters** (LoRA, :mod:`usp.models.lora`): each projection may carry a
:class:`LowRank` term, ``y += scale * (drop(x) @ a.T) @ b.T``, computed per tile in
forward and recomputed in backward, its ``a`` and ``b`` gradients accumulated in place
into buffers allocated before the loop (still memory-periodic); the dropout's mask of a
tile comes from the adapter's ``keep`` (a pure function of the tile's rows), so the
recomputation sees the forward's mask. ``tests/models/test_lora.py`` holds it against
the untiled LoRA projections through autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from usp.models.lora_dropout import apply_mask
from usp.models.tiling import representative, tiles


@dataclass(frozen=True)
class LowRank:
    """A low-rank term of one projection: ``y += scale * (drop(x) @ a.T) @ b.T``.

    ``a`` [rank, in] and ``b`` [out, rank] in the projection's dtype; ``keep``: None (no
    dropout), or rows (a slice of the flattened tokens) -> bool [rows, in], the inputs
    kept (scaled by ``1 / (1 - p)``)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    keep: Callable[[slice], torch.Tensor] | None = None
    p: float = 0.0

    def with_factors(self, a: torch.Tensor, b: torch.Tensor) -> LowRank:
        return LowRank(a, b, self.scale, self.keep, self.p)

    def mask(self, rows: slice) -> torch.Tensor | None:
        return None if self.keep is None else self.keep(rows)


def _dropped(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    return x if keep is None else apply_mask(x, keep, p)


_Adapters = tuple[LowRank | None, LowRank | None, LowRank | None]


#: the activations a tiled MLP computes (:data:`usp.models.mlp.ACTIVATIONS`' names)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _act(activation: str, x: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x, inplace=inplace)
    if inplace:
        return torch.ops.aten.gelu_(x, approximate="tanh")
    return F.gelu(x, approximate="tanh")


def _act_backward(activation: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d act(x) for the output gradient ``grad``, by the activation's own backward op,
    written over ``grad`` (elementwise)."""
    if activation == "silu":
        return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=grad)
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=grad)


def tiled_glu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile: int,
    adapters: _Adapters | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """x [..., dim], w_gate and w_up [intermediate, dim], w_down [dim, intermediate]
    -> [..., dim] (x's dtype; all four in one dtype), over tiles of ``tile`` rows
    (every dim but the last flattened). ``adapters``: a :class:`LowRank` or None for
    each of (gate, up, down) (their factors in the weights' dtype). ``activation``: one of
    :data:`ACTIVATIONS`. Without grad mode,
    or when nothing requires a gradient, the same tiles run and nothing is saved. Under
    autocast the four (and the adapters' factors) are cast to its dtype first (what
    ``nn.Linear`` does; the casts' backward returns the gradients in the weights' own
    dtype)."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be an integer >= 1, got {tile!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    adapters = adapters if adapters is not None and any(adapters) else None
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):  # as nn.Linear: every matmul in that dtype
        dtype = torch.get_autocast_dtype(device_type)
        x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
        if adapters is not None:
            adapters = tuple(
                None if a is None else a.with_factors(a.a.to(dtype), a.b.to(dtype))
                for a in adapters
            )
        with torch.autocast(device_type, enabled=False):
            return tiled_glu(x, w_gate, w_up, w_down, tile, adapters, activation)
    factors = [t for a in adapters or () if a is not None for t in (a.a, a.b)]
    needs_grad = any(t.requires_grad for t in (x, w_gate, w_up, w_down, *factors))
    if torch.is_grad_enabled() and needs_grad:
        return _TiledGLU.apply(x, w_gate, w_up, w_down, tile, adapters, activation, *factors)
    flat = x.reshape(-1, x.shape[-1])  # [..., dim] -> [rows, dim]
    weights = (w_gate, w_up, w_down)
    out = _forward_tiles(flat, weights, adapters, tile, representative(x), activation)
    return out.view(x.shape[:-1] + out.shape[-1:])


def _forward_tiles(flat, weights, adapters, tile, representative_only, activation):
    """flat [rows, dim] -> out [rows, dim], allocated here and written tile by tile."""
    out = flat.new_empty((flat.shape[0], weights[2].shape[0]))
    for rows in tiles(flat.shape[0], tile, representative_only=representative_only):
        _forward_tile(flat[rows], weights, adapters, rows, out[rows], activation)
    return out


def _with_factors(adapters, factors) -> _Adapters | None:
    """The adapters with their (saved or autograd's) factors, in (gate, up, down) order."""
    if adapters is None:
        return None
    factors, placed = list(factors), []
    for adapter in adapters:
        if adapter is None:
            placed.append(None)
        else:
            a, b = factors.pop(0), factors.pop(0)
            placed.append(adapter.with_factors(a, b))
    return tuple(placed)


class _TiledGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, tile, adapters, activation, *factors):
        flat = x.reshape(-1, x.shape[-1])  # [..., dim] -> [rows, dim]
        # decided once, kept for backward (which may run on another thread)
        ctx.representative = representative(x)
        ctx.tile, ctx.activation = tile, activation
        ctx.adapters = adapters  # scales and dropout masks (functions of the rows)
        weights = (w_gate, w_up, w_down)
        out = _forward_tiles(flat, weights, adapters, tile, ctx.representative, activation)
        ctx.save_for_backward(x, w_gate, w_up, w_down, *factors)
        return out.view(x.shape[:-1] + out.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        x, w_gate, w_up, w_down, *factors = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        adapters = _with_factors(ctx.adapters, factors)
        flat = x.reshape(-1, x.shape[-1])  # [rows, dim]
        flat_grad = grad.reshape(-1, grad.shape[-1])  # [rows, dim]
        # memory-periodic: every result exists before the loop, each tile adds in place
        dx = torch.empty_like(flat, memory_format=torch.contiguous_format) if need_x else None
        d_gate = torch.zeros_like(w_gate) if need_gate else None
        d_up = torch.zeros_like(w_up) if need_up else None
        d_down = torch.zeros_like(w_down) if need_down else None
        # the factors' gradients, (d a, d b) per adapter (None where not needed)
        needs = iter(ctx.needs_input_grad[7:])
        factor_grads = [
            None
            if a is None
            else tuple(
                torch.zeros_like(t) if next(needs) else None for t in (a.a, a.b)
            )  # fmt: skip
            for a in adapters or (None, None, None)
        ]
        for rows in tiles(flat.shape[0], ctx.tile, representative_only=ctx.representative):
            _backward_tile(
                flat_grad[rows],
                flat[rows],
                (w_gate, w_up, w_down),
                None if dx is None else dx[rows],
                (d_gate, d_up, d_down),
                adapters,
                factor_grads,
                rows,
                ctx.activation,
            )
        dx = None if dx is None else dx.view(x.shape)
        flat_factor_grads = [g for pair in factor_grads if pair is not None for g in pair]
        return (dx, d_gate, d_up, d_down, None, None, None, *flat_factor_grads)


def _add_low_rank(y, x, adapter: LowRank | None, rows: slice) -> torch.Tensor:
    """y [tile, out] += scale * (drop(x) @ a.T) @ b.T, in place (the order of autograd's
    ``out + lora_b(lora_a(drop(x))) * scale``); returns y."""
    if adapter is None:
        return y
    low = torch.mm(_dropped(x, adapter.mask(rows), adapter.p), adapter.a.t())  # [tile, rank]
    return y.add_(torch.mm(low, adapter.b.t()).mul_(adapter.scale))


def _forward_tile(x, weights, adapters, rows, out, activation) -> None:
    """One tile: x [tile, dim] -> out [tile, dim] written in place; two [tile,
    intermediate] tensors at most (plus an adapter's [tile, rank]), freed on return."""
    w_gate, w_up, w_down = weights
    gate_lr, up_lr, down_lr = adapters or (None, None, None)
    hidden = _add_low_rank(torch.mm(x, w_gate.t()), x, gate_lr, rows)  # [tile, inter]: gate(x)
    _act(activation, hidden, inplace=True)  # act(gate(x))
    hidden.mul_(_add_low_rank(torch.mm(x, w_up.t()), x, up_lr, rows))  # * up(x)
    torch.mm(hidden, w_down.t(), out=out)  # [tile, intermediate] -> [tile, dim]
    _add_low_rank(out, hidden, down_lr, rows)


def _low_rank_backward(g, x, adapter: LowRank, rows: slice, grads, need_input: bool):
    """The backward of ``y += scale * (drop(x) @ a.T) @ b.T`` for one tile: ``g`` [tile,
    out] the gradient of y, ``x`` [tile, in] the projection's input; adds to the factors'
    gradients ``grads`` (d a, d b: each None or the factor's shape) in place and returns
    the input's gradient term [tile, in] (None unless ``need_input``). The products are
    autograd's: d(low @ b.T) = g * scale first."""
    d_a, d_b = grads
    if d_a is None and d_b is None and not need_input:
        return None
    keep = adapter.mask(rows)
    scaled = g * adapter.scale  # [tile, out]
    dropped = _dropped(x, keep, adapter.p)
    if d_b is not None:  # d b += scaled.T @ low, low = drop(x) @ a.T
        d_b.addmm_(scaled.t(), torch.mm(dropped, adapter.a.t()))  # [out, tile] @ [tile, rank]
    d_low = torch.mm(scaled, adapter.b)  # [tile, out] @ [out, rank]
    if d_a is not None:  # d a += d_low.T @ drop(x)
        d_a.addmm_(d_low.t(), dropped)  # [rank, tile] @ [tile, in]
    if not need_input:
        return None
    return _dropped(torch.mm(d_low, adapter.a), keep, adapter.p)  # [tile, in]


def _backward_tile(
    g, x, weights, dx, grads, adapters=None, factor_grads=None, rows=None, activation="silu"
):
    """One tile's gradients: g (the output's gradient) and x [tile, dim]; ``dx`` [tile,
    dim] written, the weight gradients ``grads`` (each None or the weight's shape) and
    the adapters' ``factor_grads`` added to in place. Three [tile, intermediate] tensors
    at most (each buffer reused once its value is spent; an adapter adds its input-
    gradient term and [tile, rank] ones), freed on return."""
    w_gate, w_up, w_down = weights
    d_gate, d_up, d_down = grads
    gate_lr, up_lr, down_lr = adapters or (None, None, None)
    gate_fg, up_fg, down_fg = factor_grads or (None, None, None)
    need_gate_side = dx is not None or d_gate is not None or _any(gate_fg)
    need_up_side = dx is not None or d_up is not None or _any(up_fg)
    need_d_hidden = need_gate_side or need_up_side
    need_h = d_down is not None or _any(down_fg) or (down_lr is not None and need_d_hidden)
    if not (need_d_hidden or need_h):
        return
    gate = _add_low_rank(torch.mm(x, w_gate.t()), x, gate_lr, rows)  # [tile, intermediate]
    up = _add_low_rank(torch.mm(x, w_up.t()), x, up_lr, rows)
    down_term = None
    if need_h:  # out = h @ w_down.T: d w_down += g.T @ h, h = act(gate) * up
        d_hidden = _act(activation, gate).mul_(up)  # h, for now
        if d_down is not None:
            d_down.addmm_(g.t(), d_hidden)  # [dim, tile] @ [tile, intermediate]
        if down_lr is not None:
            down_term = _low_rank_backward(
                g, d_hidden, down_lr, rows, down_fg or (None, None), need_d_hidden
            )
        if not need_d_hidden:
            return
        torch.mm(g, w_down, out=d_hidden)  # h is spent: its buffer takes d h
    else:
        d_hidden = torch.mm(g, w_down)  # [tile, dim] @ [dim, intermediate]: d h
    if down_term is not None:
        d_hidden.add_(down_term)  # + the gradient through the down adapter
        del down_term
    if need_gate_side:
        d_act = up.mul_(d_hidden)  # d act(gate) = d h * up (up is spent)
        d_gated = _act_backward(activation, d_act, gate)  # d gate (written over d_act)
        if d_gate is not None:  # gate = x @ w_gate.T: d w_gate += d_gate.T @ x
            d_gate.addmm_(d_gated.t(), x)  # [intermediate, tile] @ [tile, dim]
        term = None
        if gate_lr is not None:
            term = _low_rank_backward(
                d_gated, x, gate_lr, rows, gate_fg or (None, None), dx is not None
            )
        if dx is not None:
            torch.mm(d_gated, w_gate, out=dx)  # [tile, intermediate] @ [intermediate, dim]
            if term is not None:
                dx.add_(term)
        del d_act, d_gated, term
    del up
    if need_up_side:
        d_upped = _act(activation, gate, inplace=True).mul_(d_hidden)  # d up = d h * act(gate)
        if d_up is not None:  # up = x @ w_up.T: d w_up += d_up.T @ x
            d_up.addmm_(d_upped.t(), x)
        term = None
        if up_lr is not None:
            term = _low_rank_backward(
                d_upped, x, up_lr, rows, up_fg or (None, None), dx is not None
            )
        if dx is not None:  # (written by the gate side: dx is not None needs it)
            dx.addmm_(d_upped, w_up)  # + the gradient through up
            if term is not None:
                dx.add_(term)


def _any(pair) -> bool:
    return pair is not None and any(t is not None for t in pair)

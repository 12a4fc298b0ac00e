"""The tiled SwiGLU MLP as one autograd function with a hand-written backward.

    out = down(silu(gate(x)) * up(x)),   gate(x) = x @ w_gate.T, ...

:func:`tiled_swiglu` runs forward and backward over tiles of ``tile`` tokens, so the
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
autograd uses for the untiled MLP (``mm`` backward, ``mul`` backward, silu's derivative
by ``aten.silu_backward``), row by row; the input gradient's two terms (through gate and
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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from usp.models.tiling import representative, tiles


def tiled_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile: int,
) -> torch.Tensor:
    """x [..., dim], w_gate and w_up [intermediate, dim], w_down [dim, intermediate]
    -> [..., dim] (x's dtype; all four in one dtype), over tiles of ``tile`` rows
    (every dim but the last flattened). Without grad mode, or when nothing requires a
    gradient, the same tiles run and nothing is saved. Under autocast the four are cast
    to its dtype first (what ``nn.Linear`` does; the casts' backward returns the
    gradients in the weights' own dtype)."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be an integer >= 1, got {tile!r}")
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):  # as nn.Linear: every matmul in that dtype
        dtype = torch.get_autocast_dtype(device_type)
        x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
        with torch.autocast(device_type, enabled=False):
            return tiled_swiglu(x, w_gate, w_up, w_down, tile)
    needs_grad = any(t.requires_grad for t in (x, w_gate, w_up, w_down))
    if torch.is_grad_enabled() and needs_grad:
        return _TiledSwiGLU.apply(x, w_gate, w_up, w_down, tile)
    flat = x.reshape(-1, x.shape[-1])  # [..., dim] -> [rows, dim]
    out = _forward_tiles(flat, w_gate, w_up, w_down, tile, representative(x))
    return out.view(x.shape[:-1] + out.shape[-1:])


def _forward_tiles(flat, w_gate, w_up, w_down, tile, representative_only) -> torch.Tensor:
    """flat [rows, dim] -> out [rows, dim], allocated here and written tile by tile."""
    out = flat.new_empty((flat.shape[0], w_down.shape[0]))
    for rows in tiles(flat.shape[0], tile, representative_only=representative_only):
        _forward_tile(flat[rows], w_gate, w_up, w_down, out[rows])
    return out


class _TiledSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, tile):
        flat = x.reshape(-1, x.shape[-1])  # [..., dim] -> [rows, dim]
        # decided once, kept for backward (which may run on another thread)
        ctx.representative = representative(x)
        ctx.tile = tile
        out = _forward_tiles(flat, w_gate, w_up, w_down, tile, ctx.representative)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        return out.view(x.shape[:-1] + out.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        flat = x.reshape(-1, x.shape[-1])  # [rows, dim]
        flat_grad = grad.reshape(-1, grad.shape[-1])  # [rows, dim]
        # memory-periodic: every result exists before the loop, each tile adds in place
        dx = torch.empty_like(flat, memory_format=torch.contiguous_format) if need_x else None
        d_gate = torch.zeros_like(w_gate) if need_gate else None
        d_up = torch.zeros_like(w_up) if need_up else None
        d_down = torch.zeros_like(w_down) if need_down else None
        for rows in tiles(flat.shape[0], ctx.tile, representative_only=ctx.representative):
            _backward_tile(
                flat_grad[rows],
                flat[rows],
                (w_gate, w_up, w_down),
                None if dx is None else dx[rows],
                (d_gate, d_up, d_down),
            )
        dx = None if dx is None else dx.view(x.shape)
        return dx, d_gate, d_up, d_down, None


def _forward_tile(x, w_gate, w_up, w_down, out) -> None:
    """One tile: x [tile, dim] -> out [tile, dim] written in place; two [tile,
    intermediate] tensors at most, freed on return."""
    hidden = torch.mm(x, w_gate.t())  # [tile, intermediate]: gate(x)
    F.silu(hidden, inplace=True)  # silu(gate(x))
    hidden.mul_(torch.mm(x, w_up.t()))  # * up(x)
    torch.mm(hidden, w_down.t(), out=out)  # [tile, intermediate] -> [tile, dim]


def _backward_tile(g, x, weights, dx, grads) -> None:
    """One tile's gradients: g (the output's gradient) and x [tile, dim]; ``dx`` [tile,
    dim] written, the weight gradients ``grads`` (each None or the weight's shape) added
    to in place. Three [tile, intermediate] tensors at most (each buffer reused once
    its value is spent), freed on return."""
    w_gate, w_up, w_down = weights
    d_gate, d_up, d_down = grads
    gate = torch.mm(x, w_gate.t())  # [tile, intermediate]
    up = torch.mm(x, w_up.t())
    if d_down is not None:  # out = h @ w_down.T: d w_down += g.T @ h, h = silu(gate) * up
        d_hidden = F.silu(gate).mul_(up)  # h, for now
        d_down.addmm_(g.t(), d_hidden)  # [dim, tile] @ [tile, intermediate]
        torch.mm(g, w_down, out=d_hidden)  # h is spent: its buffer takes d h
    elif dx is not None or d_gate is not None or d_up is not None:
        d_hidden = torch.mm(g, w_down)  # [tile, dim] @ [dim, intermediate]: d h
    else:
        return
    if dx is not None or d_gate is not None:
        d_act = up.mul_(d_hidden)  # d silu(gate) = d h * up (up is spent)
        # d gate, by silu's own backward (elementwise: written over its input)
        d_gated = torch.ops.aten.silu_backward.grad_input(d_act, gate, grad_input=d_act)
        if d_gate is not None:  # gate = x @ w_gate.T: d w_gate += d_gate.T @ x
            d_gate.addmm_(d_gated.t(), x)  # [intermediate, tile] @ [tile, dim]
        if dx is not None:
            torch.mm(d_gated, w_gate, out=dx)  # [tile, intermediate] @ [intermediate, dim]
        del d_act, d_gated
    del up
    if dx is not None or d_up is not None:
        d_upped = F.silu(gate, inplace=True).mul_(d_hidden)  # d up = d h * silu(gate)
        if d_up is not None:  # up = x @ w_up.T: d w_up += d_up.T @ x
            d_up.addmm_(d_upped.t(), x)
        if dx is not None:
            dx.addmm_(d_upped, w_up)  # + the gradient through up

"""The stack's norms: :class:`RMSNorm` (Llama's) and :class:`ZeroCentredRMSNorm` (Gemma 3's
and Qwen3.5's, ``1 + weight``), and RMSNorm's function with a hand-written backward
that keeps one input and one float32 column.

    y = weight * (x / rms(x)).to(x.dtype),   rms(x) = sqrt(mean(x^2, -1) + eps)

computed in float32 at least (float64 stays float64), as HF's ``LlamaRMSNorm`` does.
Autograd through those few ops saves the float32 copy of ``x`` and the normalised
``x`` in ``x.dtype`` (12 bytes per hidden value in bf16: 48 KiB per token of
Llama-3.1-8B, twice per layer), and its backward makes five float32 tensors of the
input's size at once (the planner's attribution: 80 KB per local token, the whole of
the 8B step's backward peak). :func:`rms_norm` saves ``x`` and ``1 / rms`` (one float32
value per token) and runs forward and backward over tiles of ``chunk_tokens`` tokens,
so the float32 work tensors exist for one tile at a time.

Exactness: every token's output and input gradient is computed by the same formulas as
autograd's (``ToCopy``, ``Pow``, ``Mean``, ``Rsqrt``, ``Mul`` backward), row by row, so
tiling changes nothing in them; float rounding may differ from autograd's in the last
bits where the formulas are grouped differently. The weight gradient is summed over
tiles in float32 (autograd sums once, in the product's dtype with a float32 accumulator)
and cast once. ``tests/models/test_norm.py`` holds it against autograd through the plain
formula in float64, float32 and bf16, tiled and untiled.
"""

from __future__ import annotations

import torch
from torch import nn

from usp.models.tiling import representative, tiles

#: tokens per tile of the float32 work (128 MiB per float32 tensor at hidden 4096)
NORM_CHUNK_TOKENS = 8192


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain formula, through autograd (what :func:`rms_norm` must equal)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, chunk_tokens: int | None = None
) -> torch.Tensor:
    """x [..., dim], weight [dim] -> [..., dim] in ``promote_types(weight, x)``; the
    work runs over tiles of ``chunk_tokens`` rows (every dim but the last flattened;
    default :data:`NORM_CHUNK_TOKENS`)."""
    chunk_tokens = NORM_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    return _RMSNorm.apply(x, weight, eps, chunk_tokens)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, chunk):
        wide_dtype = torch.promote_types(x.dtype, torch.float32)
        flat = x.reshape(-1, x.shape[-1])  # [..., dim] -> [rows, dim]
        out = torch.empty(
            flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
        )
        rstd = torch.empty((flat.shape[0], 1), dtype=wide_dtype, device=x.device)  # [rows, 1]
        # memory-periodic (usp.models.tiling): out and rstd exist before the loop and are
        # written in place; a tile's work tensors are freed when its function returns
        ctx.representative = representative(x)
        for rows in tiles(flat.shape[0], chunk, representative_only=ctx.representative):
            _forward_tile(flat[rows], weight, eps, out[rows], rstd[rows])
        ctx.save_for_backward(x, weight, rstd)
        ctx.chunk = chunk
        return out.view(x.shape[:-1] + out.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        flat, flat_grad = x.reshape(-1, dim), grad.reshape(-1, dim)  # [rows, dim]
        wide_dtype = rstd.dtype
        dx = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.zeros(weight.shape, dtype=wide_dtype, device=weight.device)
        # memory-periodic as the forward: dx and dw exist before the loop
        for rows in tiles(flat.shape[0], ctx.chunk, representative_only=ctx.representative):
            _backward_tile(
                flat_grad[rows],
                flat[rows],
                rstd[rows],
                weight,
                None if dx is None else dx[rows],
                dw,
            )
        dx = None if dx is None else dx.view(x.shape)
        dw = None if dw is None else dw.to(weight.dtype)
        return dx, dw, None, None


def _forward_tile(x, weight, eps, out, rstd) -> None:
    """One tile: x [tile, dim] -> out [tile, dim] and rstd [tile, 1], written in place."""
    wide = x.to(rstd.dtype)  # [tile, dim], float32 at least
    rstd.copy_(torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps))
    out.copy_(weight * (wide * rstd).to(x.dtype))


def _backward_tile(g, x, r, weight, dx, dw) -> None:
    """One tile's gradients: g, x [tile, dim], r = 1 / rms [tile, 1]; ``dx`` [tile, dim]
    written and ``dw`` [dim] (float32 at least) added to in place (either may be None)."""
    wide = x.to(r.dtype)
    if dw is not None:  # d(weight * n)/d weight = grad * n, summed over tokens
        normed = (wide * r).to(x.dtype)
        dw += (g * normed).sum(0, dtype=r.dtype)
        del normed
    if dx is None:
        return
    # d/d normed, in the dtype autograd's Mul and ToCopy backward give it
    gn = (g * weight).to(x.dtype).to(r.dtype)
    # normed = wide * r, r = rsqrt(mean(wide^2) + eps):
    #   d wide = gn * r + d(mean) * 2 * wide / dim,  d(mean) = -0.5 * r^3 * sum(gn * wide)
    d_r = (gn * wide).sum(-1, keepdim=True)  # [tile, 1]
    d_mean = -0.5 * d_r * r.pow(3)
    dx.copy_((gn * r + (d_mean / x.shape[-1]) * (2 * wide)).to(x.dtype))


class RMSNorm(nn.Module):
    """x / rms(x) * weight; normalised in float32 at least (float64 stays float64), then
    cast back before the weight, as HF does for checkpoint fidelity in bf16. Its backward
    keeps only ``x`` and one float32 value per token (:func:`rms_norm`). The weight starts
    at 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    @torch.no_grad()
    def init_weights(self, std: float, generator=None) -> None:
        self.weight.fill_(1.0)


class ZeroCentredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), normalised and multiplied in float32 at least (float64
    stays float64), then cast back (Gemma's order: the product is rounded once; ``1 +
    weight`` formed in that width, not in the weight's dtype). The weight starts at 0
    (the identity). Gemma 3's and Qwen3.5's (Qwen3-Next's) norm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(wide.dtype))).to(x.dtype)

    @torch.no_grad()
    def init_weights(self, std: float, generator=None) -> None:
        self.weight.zero_()

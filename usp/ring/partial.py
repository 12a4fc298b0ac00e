"""A partial attention result computed elsewhere, merged into a ring call's rows.

Some masks are causal attention plus a few more keys per row: Gemma 3's image blocks,
whose tokens also see the later tokens of their own image. The caller computes those
extra keys' attention itself, ``(p_out, p_lse)`` (``p_lse`` = -inf where a row has no
extra key), and the ring merges it as one more block:

    l' = logaddexp(l, p_lse),   out' = out * exp(l - l') + p_out * exp(p_lse - l').

The backward is the plain attention backward given ``out'`` and ``l'`` (the ring's
kernels form P = exp(S - l') and D = rowsum(dout * out'), exact for the merged
softmax), plus the partial's own gradients: with p = exp(p_lse - l') its share,

    d p_out = p * dout,   d p_lse = p * (rowsum(dout * p_out) - rowsum(dout * out')).

Everything is computed in the accumulation dtype (float32, float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from usp.kernels.masks import accumulation_dtype
from usp.kernels.spec import AttentionInputError


def _rows_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L] -> [B, L, H, 1]."""
    return x.transpose(1, 2).unsqueeze(-1)


def _share(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """exp(lse - total), 0 where lse is -inf (also where total is)."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - total))


def merge_partial(out, lse, p_out, p_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, L, h, D], lse [B, h, L] (the ring's), p_out [B, L, h, D], p_lse [B, h, L]
    -> (out', lse'), out' in out's dtype, lse' in the accumulation dtype."""
    acc = accumulation_dtype(out.dtype)
    lse_acc, p_acc = lse.to(acc), p_lse.to(acc)
    total = torch.logaddexp(lse_acc, p_acc)
    merged = out.to(acc) * _rows_heads(_share(lse_acc, total))
    merged = merged + p_out.to(acc) * _rows_heads(_share(p_acc, total))
    return merged.to(out.dtype), total


def partial_grads(dout, out, lse, p_out, p_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """(d p_out, d p_lse) in their own dtypes, from the merged ``out``/``lse``
    (:func:`merge_partial`'s, after any sinks)."""
    acc = accumulation_dtype(out.dtype)
    share = _share(p_lse.to(acc), lse.to(acc))  # [B, h, L]
    dout_acc = dout.to(acc)
    d_p_out = dout_acc * _rows_heads(share)
    row_gap = (dout_acc * (p_out.to(acc) - out.to(acc))).sum(-1)  # [B, L, h]
    d_p_lse = share * row_gap.transpose(1, 2)
    return d_p_out.to(p_out.dtype), d_p_lse.to(p_lse.dtype)


def check_partial(partial, spec, value_dim: int, *, eager: bool = True, mla: bool = False) -> None:
    """``partial``: None, or (out [B, S/P, H, Dv], lse [B, S/P, H]) floating-point tensors
    on q's device: attention over more keys per row, merged in (:mod:`usp.ring.partial`);
    only in an ``eager`` call (not while a compiled graph is traced), and not with a value
    head size of its own (``mla``: the kernels' padded head size)."""
    if partial is None:
        return
    if not eager or mla:
        raise AttentionInputError(
            "partial results are merged eagerly and at one head size: not under "
            "torch.compile, not with a value head size of its own (MLA)"
        )
    if not isinstance(partial, tuple) or len(partial) != 2:
        raise AttentionInputError("partial must be a tuple (out, lse) of tensors")
    out, lse = partial
    shapes = {
        "out": (spec.batch, spec.seqlen_q, spec.num_heads, value_dim),
        "lse": (spec.batch, spec.seqlen_q, spec.num_heads),
    }
    for what, tensor in (("out", out), ("lse", lse)):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise AttentionInputError(f"partial {what} must be a floating-point tensor")
        if tuple(tensor.shape) != shapes[what]:
            raise AttentionInputError(
                f"partial {what} must have shape {list(shapes[what])} (this rank's rows, every "
                f"head), got {list(tensor.shape)}"
            )
        if tensor.device != spec.device:
            raise AttentionInputError(f"partial {what} must be on q's device {spec.device}")

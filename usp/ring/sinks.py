"""Attention sinks: one learned logit per query head in every row's softmax denominator.

With a row's merged LSE ``l`` (over every key it sees, all ring blocks merged) and its
head's sink ``s`` (gpt-oss's ``sinks``), attention with a sink is

    out' = out * exp(l - l'),   l' = logaddexp(l, s) = the LSE with the sink's column,

a rescaling after the merge that no kernel needs to know about. Its backward is the
plain attention backward given ``out'`` and ``l'`` (the kernels form P = exp(S - l')
and D = rowsum(dout * out'), which are exactly the sink softmax's), plus the sink's own
gradient: with p = exp(s - l') the sink's probability, d out'/d s = -p out', so

    dsink[h] = -sum over rows of p * rowsum(dout * out').

A row that sees no key (l = -inf) gets out' = 0 and l' = s. Everything is computed in
the accumulation dtype (float32, float64 for float64 inputs), whatever the sinks' dtype.
"""

from __future__ import annotations

import torch

from usp.kernels.masks import accumulation_dtype


def _rows_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L] -> [B, L, H, 1]."""
    return x.transpose(1, 2).unsqueeze(-1)


def apply_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, L, h, D], lse [B, h, L], sinks [h] -> (out', lse'), out' in out's dtype."""
    acc = accumulation_dtype(out.dtype)
    sink = sinks.to(acc)[None, :, None]  # [1, h, 1]
    lse_acc = lse.to(acc)
    new_lse = torch.logaddexp(lse_acc, sink.expand_as(lse_acc))
    scale = torch.exp(lse_acc - new_lse)  # 0 where no key was seen
    return (out.to(acc) * _rows_heads(scale)).to(out.dtype), new_lse


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """d loss / d sinks [h] (in the sinks' dtype) from this rank's rows: out and lse are
    :func:`apply_sinks`'s. Summed over the ranks that hold the other rows (as FSDP sums
    gradients) it is the whole sequence's."""
    acc = accumulation_dtype(out.dtype)
    row_dot = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, L, h]
    prob = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc))  # [B, h, L]
    return -(prob * row_dot.transpose(1, 2)).sum(dim=(0, 2)).to(sinks.dtype)

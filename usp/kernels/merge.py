"""Merging partial attention results by their log-sum-exp.

Attention over keys K = K1 ∪ K2 splits exactly: with ``lse = log(exp(lse1) + exp(lse2))``,
``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)``. Rows where both parts saw no
key (lse1 = lse2 = -inf) stay out = 0, lse = -inf instead of becoming NaN.
"""

from __future__ import annotations

import math

import torch


def merge_into(
    acc_out: torch.Tensor, acc_lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """In place: fold one block's ``(out, lse)`` into the accumulators.

    acc_out [B, S, H, D] (float32/64)   acc_lse [B, H, S] (same dtype)
    block_out [B, S, H, D] (any float)  block_lse [B, H, S]
    The accumulators may be views (e.g. one zigzag half) of larger tensors.
    """
    new_lse = torch.logaddexp(acc_lse, block_lse)
    # -inf (no key on either side) -> 0, so the weights below are exp(-inf) = 0, not NaN;
    # NaN and +inf stay as they are (IEEE semantics, see spec.py)
    finite = torch.nan_to_num(new_lse, nan=math.nan, posinf=math.inf, neginf=0.0)
    acc_weight = torch.exp(acc_lse - finite).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    block_weight = torch.exp(block_lse - finite).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(acc_weight).addcmul_(block_out, block_weight)
    acc_lse.copy_(new_lse)


def merge_pair(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place merge of two partial results; returns accumulation-dtype tensors."""
    acc_dtype = lse1.dtype
    acc_out = out1.to(acc_dtype, copy=True)
    acc_lse = lse1.clone()
    merge_into(acc_out, acc_lse, out2, lse2.to(acc_dtype))
    return acc_out, acc_lse

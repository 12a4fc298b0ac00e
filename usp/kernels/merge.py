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
    # -inf (no key on either side) -> 0, so the block's weight below is exp(-inf) = 0, not
    # NaN; NaN and +inf stay as they are (IEEE semantics, see spec.py)
    finite = torch.nan_to_num(new_lse, nan=math.nan, posinf=math.inf, neginf=0.0)
    # the block's share of each merged row, w = exp(block_lse - lse) in [0, 1]; the
    # accumulator's is 1 - w, so acc - acc * w + block * w merges with one weight: eight
    # ops where two weights took thirteen (the ring merges once per step and block).
    # Not lerp_, which would need the block in the accumulators' dtype: a float32 copy
    # of a bf16 block, where addcmul_ converts element by element.
    block_weight = _rows_heads(torch.exp(block_lse - finite))
    acc_out.addcmul_(acc_out, block_weight, value=-1.0).addcmul_(block_out, block_weight)
    acc_lse.copy_(new_lse)


def _rows_heads(weight: torch.Tensor) -> torch.Tensor:
    """[B, H, S] -> its [B, S, H, 1] view in one op (transpose and unsqueeze are two),
    from the tensor's own strides (an elementwise result keeps its inputs' layout)."""
    batch, heads, rows = weight.shape
    b_stride, h_stride, s_stride = weight.stride()
    return weight.as_strided((batch, rows, heads, 1), (b_stride, s_stride, h_stride, 1))


def merge_pair(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place merge of two partial results; returns accumulation-dtype tensors."""
    acc_dtype = lse1.dtype
    acc_out = out1.to(acc_dtype, copy=True)
    acc_lse = lse1.clone()
    merge_into(acc_out, acc_lse, out2, lse2.to(acc_dtype))
    return acc_out, acc_lse

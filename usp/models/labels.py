"""Next-token labels for the *global* sequence.

Why before sharding: the target of token ``i`` is token ``i + 1``, which under zigzag or
contiguous placement often lives on another rank (always at the end of a rank's chunk).
Shifting inside a shard, as HF's ``labels=`` loss does, drops those targets and pairs
tokens with the wrong neighbours across the zigzag seams. Shift the global batch once,
then shard the labels exactly like the tokens.
"""

from __future__ import annotations

import torch

from usp.kernels.spec import validate_cu_seqlens

IGNORE_INDEX = -100


def shift_labels(
    input_ids: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Next-token targets of a global (unsharded) batch ``[B, S]`` (or ``[S]``).

    ``labels[..., i] = input_ids[..., i + 1]``; the last position, and with ``cu_seqlens``
    (int32 boundaries of the packed sequence) the last token of every document, get
    ``ignore_index``. ``input_ids`` may already hold ``ignore_index`` (e.g. a copy of the
    tokens with prompt positions masked for SFT): masked positions stay masked after the
    shift, so pass that copy instead of the raw tokens.
    """
    if input_ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be [B, S] or [S], got shape {tuple(input_ids.shape)}")
    if input_ids.is_floating_point():
        raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
    seq_len = input_ids.shape[-1]
    labels = torch.full_like(input_ids, ignore_index)
    labels[..., :-1] = input_ids[..., 1:]
    if cu_seqlens is not None:
        bounds = validate_cu_seqlens(cu_seqlens, seq_len, "cu_seqlens")
        ends = [end for start, end in zip(bounds, bounds[1:]) if end > start]  # skip empty docs
        last_tokens = torch.tensor(ends, dtype=torch.int64, device=input_ids.device) - 1
        labels[..., last_tokens] = ignore_index
    return labels

"""PyTorch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``).

It returns the LSE, takes an external out/LSE in its backward, handles GQA natively and
runs float32, float64, float16 and bfloat16. Its ``is_causal`` is top-left aligned, so
it is only used for square causal calls; windows go through an additive mask (which
also expresses bottom-right alignment). A fully masked row comes back with lse = 0
from the kernel; it is set to -inf here to keep the convention of ``spec.py``.
"""

from __future__ import annotations

import torch

from usp.kernels.backends.base import Backend, Grads
from usp.kernels.masks import (
    accumulation_dtype,
    lse_for_backward,
    rows_without_keys,
    visibility_mask,
)


def _additive_mask(spec, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if spec.window is None:
        return None
    visible = visibility_mask(spec.seqlen_q, spec.seqlen_k, spec.causal, spec.window, device)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
        ~visible, float("-inf")
    )


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D] (a view)


class CpuBackend(Backend):
    name = "cpu"
    device_types = ("cpu",)
    supports_window = True

    def forward(self, q, k, v, spec, scale):
        mask = _additive_mask(spec, q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            0.0,
            spec.causal and mask is None,
            attn_mask=mask,
            scale=scale,
        )
        lse = lse.to(accumulation_dtype(q.dtype))
        if mask is not None:
            empty = rows_without_keys(
                spec.seqlen_q, spec.seqlen_k, spec.causal, spec.window, q.device
            )
            if empty is not None:
                lse = lse.masked_fill(empty, float("-inf"))
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        mask = _additive_mask(spec, q.dtype, q.device)
        # the kernel reads the LSE in the input's accumulation dtype
        kernel_lse = lse_for_backward(lse).to(accumulation_dtype(q.dtype))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out),
            kernel_lse,
            0.0,
            spec.causal and mask is None,
            attn_mask=mask,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

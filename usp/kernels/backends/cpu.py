"""PyTorch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``).

It returns the LSE, takes an external out/LSE in its backward, handles GQA natively and
runs float32, float64, float16 and bfloat16. Its ``is_causal`` is top-left aligned, so
it is only used for square causal calls; windows go through an additive mask (which
also expresses bottom-right alignment).

Non-finite inputs: the kernel returns a NaN query row as zeros with lse 0, and a row
whose every score is -inf (an infinite key) with lse 0 instead of -inf, which a merge
would then count. A call whose q or k holds a NaN or an infinity therefore runs on
``math`` instead (IEEE semantics, as ``spec.py`` states). The test is one summation of
q and of k (NaN and inf survive a sum; an overflow of a huge finite sum only sends the
call to the exact path): measured at 0.3-1.6% of the kernel's forward time on CPU.
NaN or inf in v need no detour: the kernel propagates them like ``math``.
"""

from __future__ import annotations

import torch

from usp.kernels.backends.base import Backend, Grads
from usp.kernels.backends.math import MathBackend
from usp.kernels.masks import accumulation_dtype, lse_for_backward, visibility_mask


def _additive_mask(spec, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if spec.window is None:
        return None
    visible = visibility_mask(spec.seqlen_q, spec.seqlen_k, spec.causal, spec.window, device)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
        ~visible, float("-inf")
    )


_MATH = MathBackend()


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D] (a view)


def _all_finite(*tensors: torch.Tensor) -> bool:
    """False if any element is NaN or infinite (or, rarely, a finite sum overflows).
    CPU tensors only: reading the result back is not a device synchronisation here."""
    return all(bool(torch.isfinite(t.sum(dtype=accumulation_dtype(t.dtype)))) for t in tensors)


class CpuBackend(Backend):
    name = "cpu"
    device_types = ("cpu",)
    supports_window = True

    def forward(self, q, k, v, spec, scale):
        if not _all_finite(q, k):
            return _MATH.forward(q, k, v, spec, scale)
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
        return out.transpose(1, 2), lse.to(accumulation_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        if not _all_finite(q, k):
            return _MATH.backward(dout, q, k, v, out, lse, spec, scale)
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

"""PyTorch's CUDA attention kernels called through their aten ops: cuDNN, FA2 (``flash``)
and memory-efficient. These ops return the LSE and their backwards take an external
out/LSE, which is what ring attention needs.

Facts these wrappers rely on (read in the PyTorch sources of 2.6-2.13; not yet run on a
GPU: ``benchmarks/gpu_check.sh`` runs the kernel tests there, and every backend vets
itself at run time with ``usp/kernels/selfcheck.py`` before its first call):
- cuDNN takes BHSD views of any strides (so BSHD memory works without a copy), handles
  GQA natively, aligns causal masks top-left (so only square causal blocks are sent
  here), returns LSE as [B, H, S] or [B, H, S, 1] depending on the release. Its backward
  wants the LSE back in the rank its forward returned; that rank is taken from a real
  forward on the device (the meta kernel need not agree with the CUDA one). Its compiled
  backward graph is cached by q/k/v strides only and bakes in the strides of
  out/dout/LSE: every tensor is therefore made contiguous BSHD (LSE contiguous) so
  those strides always agree.
- ``_flash_attention_forward`` takes BSHD (or packed [T, H, D] with cu_seqlens), handles
  GQA natively, is bottom-right aligned, has left/right windows, and writes LSE = +inf
  for rows whose softmax sum is 0 or NaN (no visible key, or every score -inf); usp
  turns that +inf into -inf. Dense LSE is [B, H, S], varlen [H, T].
- ``_efficient_attention_forward`` takes BSHD, has no GQA (K/V heads are repeated here),
  supports float32, bottom-right causal via ``custom_mask_type=2``, and pads its LSE to
  a multiple of 32 along the sequence with +inf; its backward reads an LSE padded the
  same way and needs contiguous BSHD out. Its causal offset is unsigned in the kernel
  (``causal_diagonal_offset``), so Sq > Sk is never sent: the dispatcher cuts off the
  rows that see no key for every backend.
"""

from __future__ import annotations

import functools

import torch

from usp.kernels.backends.base import Backend, BackendFailure, Grads
from usp.kernels.backends.cuda_common import (
    HALF,
    CudaBackend,
    empty_rows_to_neg_inf,
    op_schema_has,
)
from usp.kernels.masks import lse_for_backward
from usp.kernels.spec import AttentionSpec

_CAUSAL_TOP_LEFT, _CAUSAL_BOTTOM_RIGHT = 1, 2  # efficient attention's custom_mask_type


# ------------------------------------------------------------------------------ cuDNN
@functools.cache
def _cudnn_lse_rank(device: torch.device) -> int:
    """3 ([B, H, S]) or 4 ([B, H, S, 1]): what a real forward on this device returns, which
    is what its backward expects back (not version strings, not the meta kernel)."""
    q = torch.zeros(1, 1, 16, 64, device=device, dtype=torch.bfloat16)
    lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, q, q, None, True, 0.0, False, False
    )[1]
    return lse.dim()


class CudnnBackend(CudaBackend):
    name = "cudnn"
    max_head_dim = 128
    min_seqlen_k = 2  # cannot attend to a single key: such calls go to math

    def unsupported_here(self, spec):
        if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"):
            return BackendFailure("is not in this torch build")
        if not torch.backends.cudnn.is_available():
            return BackendFailure("needs cuDNN, which this torch build lacks")
        return None

    def forward(self, q, k, v, spec, scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            True,
            0.0,
            spec.causal,
            False,
            scale=scale,
        )[:2]
        return out.transpose(1, 2), lse.reshape(spec.batch, spec.num_heads, spec.seqlen_q)

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
        kernel_lse = lse_for_backward(lse).contiguous()
        if _cudnn_lse_rank(q.device) == 4:
            kernel_lse = kernel_lse.unsqueeze(-1)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            kernel_lse,
            seed,
            offset,
            None,
            None,
            None,
            spec.seqlen_q,
            spec.seqlen_k,
            0.0,
            spec.causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ------------------------------------------------------------------------------ FA2
def _window_kwargs(spec: AttentionSpec) -> dict:
    if spec.window is None:
        return {}
    return {"window_size_left": spec.window, "window_size_right": 0 if spec.causal else -1}


@functools.cache
def _flash_varlen_lse_is_packed() -> bool:
    """Varlen LSE is [H, T] from torch 2.7 on ([B, H, max_seqlen] before): ask the meta op."""
    q = torch.empty(8, 1, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.zeros(2, dtype=torch.int32, device="meta")
    lse = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 8, 8, 0.0, False, False)[1]
    return lse.dim() == 2


def _rng_placeholders(device):
    # only read when dropout > 0, which usp never uses
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(
        0, dtype=torch.uint64, device=device
    )


class FlashBackend(CudaBackend):
    name = "flash"
    bottom_right_causal = True
    supports_window = True
    supports_varlen = True

    def unsupported_here(self, spec):
        if not torch.backends.cuda.is_flash_attention_available():
            return BackendFailure("is not in this torch build")
        if spec.window is not None and not op_schema_has(
            "_flash_attention_forward", "window_size_left"
        ):
            return "has no sliding-window support in this torch build"
        if spec.varlen and not _flash_varlen_lse_is_packed():
            return "returns an unpacked varlen LSE in this torch build (packed needs torch >= 2.7)"
        return None

    def forward(self, q, k, v, spec, scale):
        out, lse = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            None,
            None,
            spec.seqlen_q,
            spec.seqlen_k,
            0.0,
            spec.causal,
            False,
            scale=scale,
            **_window_kwargs(spec),
        )[:2]
        return out, empty_rows_to_neg_inf(lse.reshape(spec.batch, spec.num_heads, spec.seqlen_q))

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        rng_state, unused = _rng_placeholders(q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse_for_backward(lse).contiguous(),
            None,
            None,
            spec.seqlen_q,
            spec.seqlen_k,
            0.0,
            spec.causal,
            rng_state,
            unused,
            scale=scale,
            **_window_kwargs(spec),
        )
        return dq, dk, dv

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, spec, scale):
        out, lse = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            spec.causal,
            False,
            scale=scale,
            **_window_kwargs(spec),
        )[:2]
        return out, empty_rows_to_neg_inf(lse)

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, spec, scale
    ) -> Grads:
        rng_state, unused = _rng_placeholders(q.device)
        return torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse_for_backward(lse).contiguous(),
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            spec.causal,
            rng_state,
            unused,
            scale=scale,
            **_window_kwargs(spec),
        )


# ------------------------------------------------------------------------------ efficient
def _repeat_kv(x: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, H, D], each KV head repeated for its group of query heads
    (expand + reshape: shape arithmetic only, no device value read back)."""
    groups = spec.num_heads // spec.num_kv_heads
    if groups == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand(b, s, h, groups, d).reshape(b, s, h * groups, d)


def _sum_kv_groups(grad: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    groups = spec.num_heads // spec.num_kv_heads
    if groups == 1:
        return grad
    b, s, _, d = grad.shape
    return grad.view(b, s, spec.num_kv_heads, groups, d).sum(dim=3)


def efficient_kernel_lse(lse: torch.Tensor) -> torch.Tensor:
    """[B, H, Sq] -> [B, H, ceil(Sq / 32) * 32] float32, contiguous: the LSE laid out as
    the kernel's own forward writes it, the padding rows +inf (exp(s - lse) = 0 there)."""
    batch, heads, seqlen_q = lse.shape
    padded = -(-seqlen_q // 32) * 32
    kernel_lse = torch.full(
        (batch, heads, padded), float("inf"), dtype=torch.float32, device=lse.device
    )
    kernel_lse[:, :, :seqlen_q] = lse_for_backward(lse)
    return kernel_lse


class EfficientBackend(CudaBackend):
    name = "efficient"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    bottom_right_causal = True
    head_dim_multiple = 4
    max_head_dim = 256

    def unsupported_here(self, spec):
        if not hasattr(torch.ops.aten, "_efficient_attention_backward"):
            return BackendFailure("is not in this torch build")
        if spec.dtype in HALF and spec.head_dim % 8:
            return f"needs head_dim a multiple of 8 for {spec.dtype}, got {spec.head_dim}"
        return None

    def _mask_type(self, spec):
        return _CAUSAL_BOTTOM_RIGHT if spec.causal else 0

    def forward(self, q, k, v, spec, scale):
        out, lse = torch.ops.aten._efficient_attention_forward(
            q,
            _repeat_kv(k, spec),
            _repeat_kv(v, spec),
            None,
            None,
            None,
            None,
            None,
            0.0,
            self._mask_type(spec),
            True,
            scale=scale,
        )[:2]
        # [B, H, ceil(Sq / 32) * 32] -> [B, H, Sq]; every row sees a key (see api.py)
        return out, empty_rows_to_neg_inf(lse[:, :, : spec.seqlen_q])

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout.contiguous(),
            q,
            _repeat_kv(k, spec),
            _repeat_kv(v, spec),
            None,
            out.contiguous(),
            None,
            None,
            spec.seqlen_q,
            spec.seqlen_k,
            efficient_kernel_lse(lse),
            0.0,
            seed,
            offset,
            self._mask_type(spec),
            False,
            scale=scale,
        )
        return dq, _sum_kv_groups(dk, spec), _sum_kv_groups(dv, spec)


def make(name: str) -> Backend:
    return {"cudnn": CudnnBackend, "flash": FlashBackend, "efficient": EfficientBackend}[name]()

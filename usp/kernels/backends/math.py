"""Plain-torch attention: any device, any float dtype (float64 included). The reference.

Scores are materialised ([B, Hkv, g, Sq, Sk]), so this is for tests and small shapes.
K/V are never repeated for GQA: query heads are viewed as [Hkv, g] groups.
"""

from __future__ import annotations

import torch

from usp.kernels.backends.base import Backend, Grads
from usp.kernels.masks import accumulation_dtype, lse_for_backward, visibility_mask
from usp.kernels.spec import AttentionSpec


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # [B, Sq, H, D] -> [B, Sq, Hkv, g, D]
    b, s, h, d = q.shape
    return q.reshape(b, s, num_kv_heads, h // num_kv_heads, d)


def _masked_scores(q, k, spec: AttentionSpec, scale: float, compute: torch.dtype) -> torch.Tensor:
    qg = _grouped(q.to(compute), spec.num_kv_heads)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(compute)) * scale  # [B, Hkv, g, Sq, Sk]
    mask = visibility_mask(spec.seqlen_q, spec.seqlen_k, spec.causal, spec.window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _grouped_lse(lse: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    # [B, H, Sq] -> [B, Hkv, g, Sq]
    b, h, s = lse.shape
    return lse.reshape(b, spec.num_kv_heads, h // spec.num_kv_heads, s)


class MathBackend(Backend):
    name = "math"
    device_types = ("cpu", "cuda", "mps", "xpu", "meta")
    bottom_right_causal = True
    supports_window = True
    self_checked = False  # it is the reference the self-check compares against

    def forward(self, q, k, v, spec, scale):
        compute = accumulation_dtype(q.dtype)
        scores = _masked_scores(q, k, spec, scale, compute)
        lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, g, Sq]; -inf for rows seeing nothing
        probs = torch.exp(scores - lse_for_backward(lse).unsqueeze(-1))
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(compute))
        out = out.reshape(q.shape[:-1] + (v.shape[-1],)).to(q.dtype)
        return out, lse.reshape(spec.batch, spec.num_heads, spec.seqlen_q)

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        compute = accumulation_dtype(q.dtype)
        scores = _masked_scores(q, k, spec, scale, compute)
        lse_g = lse_for_backward(_grouped_lse(lse.to(compute), spec))
        probs = torch.exp(scores - lse_g.unsqueeze(-1))  # [B, Hkv, g, Sq, Sk]
        dout_g = _grouped(dout.to(compute), spec.num_kv_heads)  # [B, Sq, Hkv, g, D]
        dv = torch.einsum("bhgqk,bqhgd->bkhd", probs, dout_g)
        dprobs = torch.einsum("bqhgd,bkhd->bhgqk", dout_g, v.to(compute))
        row_dot = (dout_g * _grouped(out.to(compute), spec.num_kv_heads)).sum(-1)  # [B, Sq, Hkv, g]
        dscores = probs * (dprobs - row_dot.permute(0, 2, 3, 1).unsqueeze(-1)) * scale
        dq = torch.einsum("bhgqk,bkhd->bqhgd", dscores, k.to(compute)).reshape(q.shape)
        dk = torch.einsum("bhgqk,bqhgd->bkhd", dscores, _grouped(q.to(compute), spec.num_kv_heads))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

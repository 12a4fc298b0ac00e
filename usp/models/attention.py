"""The attention part: grouped-query self-attention, projections and RoPE on a rank's
tokens, USP attention across the SP group (``plan.attention``: exact over the global
sequence, windows and sinks included).

What a family adds to plain GQA is an :class:`AttentionOptions` value (which
projections carry a bias, per-head q/k norms, an output gate, sinks, the softmax
scale); the layer's window and RoPE come per layer (:class:`usp.models.parts.LayerParts`).
Parameter names are transformers' (``self_attn.q_proj``, ``q_norm``, ``sinks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from usp.models.rope import apply_rope


@dataclass(frozen=True)
class AttentionOptions:
    """A family's attention beyond GQA with RoPE.

    * ``qkv_bias``, ``o_bias``: biases on the q/k/v and the output projections;
    * ``qk_norm``: a norm over each head's dims of q and k before RoPE (``q_norm``,
      ``k_norm``; the stack's norm: Qwen3's RMSNorm, Gemma 3's and Qwen3.5's
      zero-centred one);
    * ``output_gate``: ``q_proj`` gives each head's query and a gate (``[q | gate]``), the
      output is multiplied by ``sigmoid(gate)`` before ``o_proj`` (Qwen3.5);
    * ``sinks``: one learned logit per query head, an extra softmax column that takes
      probability and gives no value (gpt-oss);
    * ``softmax_scale``: None for ``head_dim ** -0.5`` (Gemma 3: ``query_pre_attn_scalar
      ** -0.5``).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    output_gate: bool = False
    sinks: bool = False
    softmax_scale: float | None = None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head (all of them but for a
    partial RoPE); the rest pass through. x [B, S, H, D], cos/sin [B or 1, S, rotary]."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


class Attention(nn.Module):
    """Self-attention of one decoder layer (``self_attn``): x [B, S/P, dim] -> [B, S/P,
    dim]; ``window`` its sliding window (None: full causal), ``norm`` the class of its
    q/k norms."""

    def __init__(self, config, plan, options: AttentionOptions, window: int | None, norm):
        super().__init__()
        self.plan = plan
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        dim, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.gated = options.output_gate
        self.q_proj = nn.Linear(dim, q_dim * (2 if self.gated else 1), bias=options.qkv_bias)
        self.k_proj = nn.Linear(dim, kv_dim, bias=options.qkv_bias)
        self.v_proj = nn.Linear(dim, kv_dim, bias=options.qkv_bias)
        self.o_proj = nn.Linear(q_dim, dim, bias=options.o_bias)
        if options.qk_norm:  # over each head's dims
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        #: per-head sink logits [H] (gpt-oss), None: no sinks
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if options.sinks else None
        self.scale = options.softmax_scale or self.head_dim**-0.5
        self.window = window
        # groups of KV heads the ring attends to one after the other: 1 unless a lever
        # (usp.models.Levers.attention_head_chunks) sets it; the same numbers either way
        self.head_chunks = 1

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """The sinks normal(0, std) (the projections and norms initialise themselves)."""
        if self.sinks is not None:
            self.sinks.normal_(0.0, std, generator=generator)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed=None):
        batch, tokens, _ = x.shape  # [B, S/P, dim]
        q = self.q_proj(x).view(batch, tokens, self.num_heads, -1)  # [B, S/P, H, D or 2D]
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)  # [B, S/P, H, D] each
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # (None: a layer without RoPE, Granite's "nope")
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = self.plan.attention(
            q,
            k,
            v,
            causal=True,
            softmax_scale=self.scale,
            packed=packed,
            head_chunks=self.head_chunks,
            window=self.window,
            sinks=self.sinks,
        )  # fmt: skip  (out [B, S/P, H, D], exact attention over the global sequence)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window is not None else ""

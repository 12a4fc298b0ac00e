"""Kimi-Linear's Kimi Delta Attention layer, computed by usp (exact under SP).

:class:`KimiDeltaAttention` has transformers' ``KimiLinearDeltaAttention`` parameters
under the same names (``q_proj``, ``k_proj``, ``v_proj``, ``conv1d``,
``forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}``, ``b_proj``, ``g_a_proj``,
``g_b_proj``, ``o_norm``, ``o_proj``; a state dict loads either way) and its forward:
the projections, the causal depthwise conv over (q, k, v) with its activation, the decay
of every key channel ``g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`` (per head,
[B, S, H, dk]), ``beta = sigmoid(b_proj(x))``, the delta rule with q/k l2-normalised
and q scaled by dk**-0.5, the output's RMSNorm per head times ``sigmoid(g_b(g_a(x)))``,
and the output projection. Everything but the conv and the recurrence is token-local and
runs on the rank's sequence shard; those two go through :func:`usp.linear.kda_usp`.

Precision: float64 modules compute the decay, the recurrence and the norm in float64;
other dtypes compute them in float32, as transformers does (its norm casts back to the
activations' dtype at the end, as here). transformers writes the softplus as
``log(1 + exp(x))`` below 20; torch's ``softplus`` (here) is ``log1p(exp(x))`` there:
equal but for x below about -17 in float32 (0 against ~1e-8), and its gradient stays
finite where ``exp(x)`` overflows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from usp.linear.backends import KDA_DEFAULT
from usp.linear.choice import GdnShape, layer_kernel_refusal
from usp.linear.kda import kda_usp
from usp.linear.kernel import compute_dtype
from usp.linear.layer_call import call_documents

__all__ = ["KdaForgetGate", "KimiDeltaAttention", "SigmoidGatedRMSNorm"]


class KdaForgetGate(nn.Module):
    """The per-channel log decay of Kimi Delta Attention (transformers'
    ``KimiLinearForgetGate``): [B, S, hidden] -> [B, S, H, dk] in the compute dtype."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(hidden_states.dtype)
        f = self.f_b_proj(self.f_a_proj(hidden_states)).to(dtype) + self.dt_bias.to(dtype)
        f = f.unflatten(-1, (self.num_heads, self.head_dim))  # [B, S, H, dk]
        return -self.A_log.to(dtype).exp() * F.softplus(f)


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over the last dim times sigmoid(gate), in the compute dtype (the weight
    too), cast back to x's dtype (transformers' ``KimiLinearRMSNormGated``)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype)
        h = x.to(dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight.to(dtype) * h * torch.sigmoid(gate.to(dtype))
        return h.to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention token mixer: [B, S/P, hidden] -> [B, S/P, hidden] on a rank's
    shard. ``plan``: the :class:`usp.Plan` used when ``forward`` gets none (None: one
    process). ``chunk_size``, ``kernel``, ``conv_kernel``: as :func:`usp.linear.kda_usp`'s
    (None: the plan's ``linear_backend`` / ``linear_conv_backend``)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_kernel_size: int = 4,
        rms_norm_eps: float = 1e-6,
        activation: str = "silu",
        *,
        plan=None,
        chunk_size: int = 64,
        kernel: str | None = None,
        conv_kernel: str | None = None,
    ):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv_dim = num_heads * head_dim
        self.activation = activation
        self.plan, self.chunk_size = plan, chunk_size
        self.kernel, self.conv_kernel = kernel, conv_kernel
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(hidden_size, self.qkv_dim, bias=False) for _ in "qkv"
        )
        self.conv1d = nn.Conv1d(
            3 * self.qkv_dim, 3 * self.qkv_dim, conv_kernel_size, groups=3 * self.qkv_dim,
            bias=False, padding=conv_kernel_size - 1,
        )  # fmt: skip
        self.forget_gate = KdaForgetGate(hidden_size, num_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps=rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False)

    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    def kernel_refusal(self, plan=None, *, device=None, dtype=None) -> str | None:
        """Why a kernel the plan (default: the layer's) forces cannot run this layer on
        ``device`` with activations of ``dtype`` (default: its parameters'), or None
        (:func:`usp.linear.choice.forced_kernel_refusal`; no kernel runs)."""
        heads, dim = self.num_heads, self.head_dim
        shape = GdnShape(heads, heads, dim, dim, self.conv1d.kernel_size[0])
        return layer_kernel_refusal(self, plan, device, dtype, shape, mixer="KDA",
                                    kernels=KDA_DEFAULT)  # fmt: skip

    def forward(self, hidden_states, cache=None, attention_mask=None, *, plan=None, packed=None,
                **kwargs):  # fmt: skip
        """``packed``: the global document boundaries (cu_seqlens or a PackedSequence of the
        plan); a ``usp_packed`` (the HF plug-in's) or ``cu_seq_lens_q`` (transformers'
        padding-free batches) keyword is read as ``packed`` too. ``cache`` and a padding
        ``attention_mask`` are refused."""
        packed = call_documents("KimiDeltaAttention", cache, attention_mask, packed, kwargs)
        plan = self.plan if plan is None else plan
        heads = (self.num_heads, self.head_dim)
        q, k, v = (p(hidden_states).unflatten(-1, heads) for p in (self.q_proj, self.k_proj,
                                                                   self.v_proj))  # fmt: skip
        dtype = compute_dtype(hidden_states.dtype)
        g = self.forget_gate(hidden_states)  # [B, S/P, H, dk]
        beta = self.b_proj(hidden_states).to(dtype).sigmoid()
        core = kda_usp(
            q,
            k,
            v,
            g,
            beta,
            plan,
            conv_weights=self.conv1d.weight[:, 0].split([self.qkv_dim] * 3),
            activation=self.activation,
            packed=packed,
            chunk_size=self.chunk_size,
            kernel=self.kernel,
            conv_kernel=self.conv_kernel,
        )  # fmt: skip  [B, S/P, H, dk]
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).unflatten(-1, heads)
        return self.o_proj(self.o_norm(core, gate).flatten(2))

"""The Mamba-2 mixer of transformers' hybrid models (Bamba, Granite 4 hybrid, Nemotron-H,
Falcon-H1, Zamba2), computed by usp (exact under SP).

:class:`Mamba2Mixer` has the parameters of transformers' Mamba-2 mixers under the same
names (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``; a
state dict loads either way) and their forward: the input projection into the gate z, the
conv's inputs (x, B, C) and dt; the causal conv with its bias and SiLU;
``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``, ``A = -exp(A_log)``; the SSD
scan with the D skip; the gated RMSNorm over ``norm_groups`` groups (z gates before the
norm, as transformers' ``*RMSNormGated`` with ``norm_before_gate=False``; Falcon-H1 may
gate after it, or have no norm and gate alone); the output projection. Falcon-H1's
multipliers (``ssm_in_multiplier`` on the input, ``mup_vector`` on the projection) are
taken as they are. Everything but the conv and the scan is token-local and runs on the
rank's sequence shard; those two go through :func:`usp.linear.mamba2_usp`.

Precision: the scan and the norm compute in float32 (float64 for float64 modules), as
transformers' torch path does in float32 whatever the module's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from usp.linear.kernel import compute_dtype
from usp.linear.mamba2 import mamba2_usp

__all__ = ["GroupGatedRMSNorm", "Mamba2Mixer"]


class GroupGatedRMSNorm(nn.Module):
    """RMSNorm over ``groups`` groups of the last dim, gated by silu(z) before the norm
    (``gate_first``, transformers' default) or after it; weight [size]."""

    def __init__(self, size: int, groups: int = 1, eps: float = 1e-6, gate_first: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps
        self.groups = groups
        self.gate_first = gate_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype)
        h, gate = x.to(dtype), F.silu(gate.to(dtype))
        if self.gate_first:
            h = h * gate
        h = h.unflatten(-1, (self.groups, -1))  # [.., groups, size / groups]
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
        h = self.weight * h.to(x.dtype)
        return h if self.gate_first else (h * gate).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 token mixer: [B, S/P, hidden] -> [B, S/P, hidden] on a rank's shard.

    ``norm``: ``"gated"`` (z gates, then the grouped RMSNorm), ``"gated_after"`` (the norm,
    then z gates) or None (z gates, no norm). ``plan``: the :class:`usp.Plan` used when
    ``forward`` gets none (None: one process). ``chunk_size``, ``kernel``,
    ``conv_kernel``: as :func:`usp.linear.mamba2_usp`'s (None: the plan's)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel_size: int = 4,
        *,
        proj_bias: bool = False,
        out_bias: bool | None = None,
        conv_bias: bool = True,
        activation: str = "silu",
        time_step_limit: tuple[float, float] = (0.0, math.inf),
        norm: str | None = "gated",
        norm_eps: float = 1e-6,
        in_multiplier: float | None = None,
        mup_vector: torch.Tensor | None = None,
        plan=None,
        chunk_size: int = 64,
        kernel: str | None = None,
        conv_kernel: str | None = None,
    ):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.ssm_state_size = n_groups, state_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.activation = activation
        self.time_step_limit = tuple(time_step_limit)
        self.in_multiplier = in_multiplier
        self.plan, self.chunk_size = plan, chunk_size
        self.kernel, self.conv_kernel = kernel, conv_kernel
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=conv_bias,
            padding=conv_kernel_size - 1,
        )  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.gate_only = norm is None
        if norm is not None:
            self.norm = GroupGatedRMSNorm(
                self.intermediate_size, n_groups, norm_eps, gate_first=norm == "gated"
            )
        out_bias = proj_bias if out_bias is None else out_bias
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=out_bias)
        if mup_vector is not None:  # Falcon-H1's (not in its checkpoints)
            self.register_buffer("mup_vector", mup_vector.clone(), persistent=False)
        else:
            self.mup_vector = None

    def forward(self, hidden_states, cache=None, attention_mask=None, *, plan=None, packed=None,
                **kwargs):  # fmt: skip
        """``packed``: the global document boundaries (cu_seqlens or a PackedSequence of the
        plan); a ``usp_packed`` (the HF plug-in's) or ``cu_seq_lens_q`` (transformers'
        padding-free batches) keyword is read as ``packed`` too. ``cache`` and a padding
        ``attention_mask`` are refused."""
        if cache is not None:
            raise ValueError("Mamba2Mixer (usp) computes training forwards: pass use_cache=False")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("Mamba2Mixer (usp) does not take padding; pack documents instead")
        if packed is None:
            packed = kwargs.get("usp_packed", kwargs.get("cu_seq_lens_q"))
        plan = self.plan if plan is None else plan
        batch, seq_len, _ = hidden_states.shape
        if self.in_multiplier is not None:
            hidden_states = hidden_states * self.in_multiplier
        projected = self.in_proj(hidden_states)
        if self.mup_vector is not None:
            projected = projected * self.mup_vector
        groups = self.n_groups * self.ssm_state_size
        z, x, b, c, dt = projected.split(
            [self.intermediate_size, self.intermediate_size, groups, groups, self.num_heads], -1
        )
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.time_step_limit)
        dtype = compute_dtype(hidden_states.dtype)
        y = mamba2_usp(
            x.unflatten(-1, (self.num_heads, self.head_dim)),
            b.unflatten(-1, (self.n_groups, self.ssm_state_size)),
            c.unflatten(-1, (self.n_groups, self.ssm_state_size)),
            dt.to(dtype),
            -torch.exp(self.A_log.to(dtype)),
            plan,
            d=self.D,
            conv_weight=self.conv1d.weight[:, 0],
            conv_bias=self.conv1d.bias,
            activation=self.activation,
            packed=packed,
            chunk_size=self.chunk_size,
            kernel=self.kernel,
            conv_kernel=self.conv_kernel,
        ).flatten(2)  # fmt: skip  [B, S/P, H * P] in the compute dtype
        y = y * F.silu(z.to(y.dtype)) if self.gate_only else self.norm(y, z)
        return self.out_proj(y.to(hidden_states.dtype))

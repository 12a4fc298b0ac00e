"""The Gated DeltaNet layer of Qwen3.5 / Qwen3-Next, computed by usp (exact under SP).

:class:`GatedDeltaNet` has transformers' ``Qwen3_5GatedDeltaNet`` parameters under the
same names (a state dict loads either way) and its forward: projections, the causal
depthwise conv with SiLU, q/k l2-norm, ``g = -exp(A_log) softplus(a + dt_bias)``,
``beta = sigmoid(b)``, the gated delta rule, the gated RMSNorm per value head and the
output projection. Everything but the conv and the recurrence is token-local and runs on
the rank's sequence shard; those two go through :func:`usp.linear.gated_deltanet_usp`.

Precision: float64 modules compute in float64 throughout (transformers' torch path
computes the decay, the recurrence and the norm in float32 whatever the module's dtype);
other dtypes compute those in float32, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from usp.linear.choice import GdnShape, forced_kernel_refusal, plan_choice
from usp.linear.gdn import gated_deltanet_usp
from usp.linear.kernel import compute_dtype
from usp.linear.layer_call import call_documents


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then times silu(gate) (transformers' RMSNormGated)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype)
        h = x.to(dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(dtype))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: [B, S/P, hidden] -> [B, S/P, hidden] on a rank's shard.

    ``plan``: the :class:`usp.Plan` used when ``forward`` gets none (None: one process).
    ``chunk_size``: the kernel's chunk length (work, not results). ``kernel``: the
    recurrence's kernel, ``"auto"``, ``"torch"`` or ``"fla"`` (:mod:`usp.linear.backends`);
    ``conv_kernel``: the short conv's, ``"auto"``, ``"torch"`` or ``"causal_conv1d"``
    (:mod:`usp.linear.conv`); None (default): the plan's ``linear_backend`` /
    ``linear_conv_backend`` (``"auto"`` without a plan).
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
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
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.activation = activation
        self.plan = plan
        self.chunk_size = chunk_size
        self.kernel = kernel
        self.conv_kernel = conv_kernel
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
            padding=conv_kernel_size - 1,
        )  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)

    @classmethod
    def from_config(cls, config, **kwargs) -> GatedDeltaNet:
        """From a transformers Qwen3.5 / Qwen3-Next text config."""
        return cls(
            config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
            config.linear_key_head_dim, config.linear_value_head_dim,
            config.linear_conv_kernel_dim, config.rms_norm_eps, config.hidden_act, **kwargs,
        )  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        attention_mask=None,
        *,
        plan=None,
        packed=None,
        **kwargs,
    ) -> torch.Tensor:
        """``packed``: the global document boundaries (cu_seqlens or a PackedSequence of
        the plan); a ``cu_seq_lens_q`` keyword (transformers' padding-free batches) is
        read as ``packed`` too, as is the HF plug-in's ``usp_packed``. ``cache`` and a padding ``attention_mask`` are refused."""
        packed = call_documents("GatedDeltaNet", cache, attention_mask, packed, kwargs)
        plan = self.plan if plan is None else plan
        batch, seq_len, _ = hidden_states.shape
        dtype = compute_dtype(hidden_states.dtype)
        q, k, v, z, b, a = self._project(hidden_states)
        beta = b.to(dtype).sigmoid()
        a = a.to(dtype)
        g = -self.A_log.to(dtype).exp() * F.softplus(a + self.dt_bias.to(dtype))
        weights = self.conv1d.weight[:, 0].split([self.key_dim, self.key_dim, self.value_dim])
        core = gated_deltanet_usp(
            q,
            k,
            v,
            g,
            beta,
            plan,
            conv_weights=weights,
            activation=self.activation,
            packed=packed,
            chunk_size=self.chunk_size,
            kernel=self.kernel,
            conv_kernel=self.conv_kernel,
        )  # fmt: skip  [B, S/P, H, dv]
        core = self.norm(core, z)
        return self.out_proj(core.reshape(batch, seq_len, self.value_dim))

    def shape(self) -> GdnShape:
        return GdnShape(
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
            self.conv1d.weight.shape[-1],
        )  # fmt: skip

    def kernel_refusal(
        self, plan=None, *, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> str | None:
        """Why the kernels this layer would run under ``plan`` (default: its own plan)
        cannot run on ``device`` with activations of ``dtype`` (default: its parameters'
        device and dtype), or None: :func:`usp.linear.choice.forced_kernel_refusal`, a
        forced kernel's limits. Runs no kernel."""
        plan = self.plan if plan is None else plan
        weight = self.conv1d.weight
        return forced_kernel_refusal(
            plan_choice(self.kernel, plan, "linear_backend"),
            plan_choice(self.conv_kernel, plan, "linear_conv_backend"),
            weight.device if device is None else device,
            weight.dtype if dtype is None else dtype,
            self.shape(),
            1 if plan is None else plan.ulysses_degree,
        )

    def _project(self, x):
        """q, k [B, S, Hk, dk], v, z [B, S, H, dv], b, a [B, S, H] (Qwen3.5's projections)."""
        q, k, v = self.in_proj_qkv(x).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)


class GatedDeltaNetQkvz(GatedDeltaNet):
    """Qwen3-Next's layout of the same layer: one ``in_proj_qkvz`` and one ``in_proj_ba``
    whose outputs are grouped per key head (q, k, then the key head's value heads' v and
    z; its value heads' b, then a), as transformers' ``Qwen3NextGatedDeltaNet``."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, *args, **kwargs):
        super().__init__(hidden_size, num_k_heads, num_v_heads, *args, **kwargs)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        self.in_proj_qkvz = nn.Linear(
            hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)

    def _project(self, x):
        per = self.num_v_heads // self.num_k_heads  # value heads per key head
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.num_k_heads, -1))  # [B, S, Hk, ...]
        q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
        b, a = self.in_proj_ba(x).unflatten(-1, (self.num_k_heads, -1)).split([per, per], dim=-1)
        v, z = (t.flatten(2).unflatten(-1, (self.num_v_heads, dv)) for t in (v, z))
        return q, k, v, z, b.flatten(2), a.flatten(2)

"""gpt-oss's mixture-of-experts MLP, a part the stack composes (transformers' ``mlp``):
the router (``mlp.router``: a linear layer with bias; the top-k logits, a softmax over
those k) and experts with biases and a clamped SwiGLU, gate and up interleaved in
``gate_up_proj``'s last dim: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha *
g)``, ``g = clamp(gate, max=limit)``. Weights are held, loaded and saved in
transformers' own layout (``gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias`` [E, 2I],
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]: the published bf16 checkpoints'
keys too). The sorting by expert, the router statistics, the load-balancing loss and
the tiles of routed rows are :mod:`usp.models.moe`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from usp.models.moe import Experts, SparseMoE, segment_sizes, stats_dtype
from usp.models.moe_op import register_experts_kind


class GptOssRouter(nn.Module):
    """``x`` [N, H] -> (softmax over all logits [N, E] in :func:`stats_dtype`, for the
    load-balancing statistics; the softmax of the top-k logits [N, k] in ``x``'s dtype;
    the top-k experts [N, k]). Logits ``x W^T + b``; the k-way softmax runs in float32 at
    least (transformers: in the logits' dtype; equal in float32/float64)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight, self.bias).to(stats_dtype(x.dtype))  # [N, E]
        top, experts = torch.topk(logits, self.top_k, dim=-1)  # [N, k]
        weights = torch.softmax(top, dim=-1)
        return torch.softmax(logits, dim=-1), weights.to(x.dtype), experts

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.weight.normal_(0.0, std, generator=generator)
        self.bias.normal_(0.0, std, generator=generator)

    def matmul_parameters(self) -> int:
        return self.weight.numel()


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: [..., 2I] (gate, up interleaved) -> [..., I]."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(Experts):
    """``E`` experts with biases and :func:`clamped_swiglu`, in transformers' layout
    (weights [E, in, out], checkpoints hold the grouped tensors); run sorted by expert
    as :class:`usp.models.moe.Experts` (a grouped GEMM where torch has one)."""

    per_expert_checkpoint = False

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        alpha: float,
        limit: float,
    ):
        nn.Module.__init__(self)
        self.num_experts, self.top_k, self.alpha, self.limit = num_experts, top_k, alpha, limit
        inner = 2 * intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, inner))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.grouped_gemm: bool | None = None

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.gate_up_proj.normal_(0.0, std, generator=generator)
        self.down_proj.normal_(0.0, std, generator=generator)
        self.gate_up_proj_bias.zero_()
        self.down_proj_bias.zero_()

    def routed_parameters(self) -> int:
        """Parameters of the ``top_k`` experts one token uses (biases included)."""
        return sum(p[0].numel() for p in self.parameters()) * self.top_k

    kind = "gpt_oss"

    def op_params(self) -> list[torch.Tensor]:
        return [self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias]

    def op_options(self) -> list[float]:
        return [float(self.alpha), float(self.limit)]


def _run_gpt_oss(rows, counts, row_experts, params, options, grouped) -> torch.Tensor:
    """rows [M, H] sorted by expert, counts [E], row_experts [M] -> [M, H]: gpt-oss's
    experts (``params`` as :meth:`GptOssExperts.op_params`, ``options`` alpha and limit)
    on their segments."""
    gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias = params
    alpha, limit = options
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # [E] segment ends (no host sync)
        gate_up = torch._grouped_mm(rows, gate_up_proj, offs=offsets)  # [M, 2I]
        gate_up = gate_up + gate_up_proj_bias.index_select(0, row_experts)
        hidden = clamped_swiglu(gate_up, alpha, limit)  # [M, I]
        out = torch._grouped_mm(hidden, down_proj, offs=offsets)  # [M, H]
        return out + down_proj_bias.index_select(0, row_experts)
    # unbind once (as usp.models.moe's segments do): one backward writes every expert's
    # gradient into one [E, ...] tensor, where indexing per expert would give each
    # expert a full-size zero gradient
    gate_ups, gate_up_biases, downs, down_biases = (p.unbind(0) for p in params)
    outputs = []
    for expert, segment in enumerate(rows.split(segment_sizes(rows, counts))):
        if segment.shape[0]:
            gate_up = torch.addmm(gate_up_biases[expert], segment, gate_ups[expert])  # [n, 2I]
            hidden = clamped_swiglu(gate_up, alpha, limit)  # [n, I]
            outputs.append(torch.addmm(down_biases[expert], hidden, downs[expert]))  # [n, H]
    return torch.cat(outputs) if outputs else rows.new_zeros(rows.shape)


register_experts_kind("gpt_oss", _run_gpt_oss)


class GptOssMoE(SparseMoE):
    """gpt-oss's ``mlp``: ``router`` + ``experts`` (x [B, S/P, H] -> [B, S/P, H], token by
    token; router statistics collected as :class:`usp.models.moe.SparseMoE` does)."""

    def __init__(self, config):
        nn.Module.__init__(self)
        self.router = GptOssRouter(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok
        )
        self.experts = GptOssExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            config.num_experts_per_tok,
            config.swiglu_alpha,
            config.swiglu_limit,
        )
        self.shared_expert = self.shared_expert_gate = None  # gpt-oss has none

    def route(self, flat: torch.Tensor):
        return self.router(flat)

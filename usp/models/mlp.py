"""The dense MLP part: a gated MLP, ``down(act(gate(x)) * up(x))``, token-local.

``act`` is SiLU (SwiGLU: Llama, Qwen, Mistral, the MoE families' dense layers and shared
experts) or tanh-approximated GELU (GeGLU: Gemma 3's ``gelu_pytorch_tanh``), held as the
module ``act_fn`` as transformers holds it. :class:`FusedGatedMLP` is the same MLP with
the gate and up projections in one matrix (Granite's ``input_linear``). The tiled variant is a lever
(:class:`usp.models.Levers` ``mlp_tile_tokens``, :func:`usp.models.mlp_tiles.tiled_glu`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: transformers' names of the activations a gated MLP here computes, and their modules
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


class MLP(nn.Module):
    """x [..., hidden] -> [..., hidden]: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``,
    no biases (transformers' names)."""

    def __init__(self, config, intermediate_size: int | None = None, activation: str = "silu"):
        """``intermediate_size``: ``config.intermediate_size`` unless given (e.g. a
        mixture-of-experts block's shared expert); ``activation``: a name of
        :data:`ACTIVATIONS`."""
        super().__init__()
        dim = config.hidden_size
        hidden = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """x [..., hidden] -> [..., hidden]: ``output_linear(silu(g) * u)`` with ``[g | u] =
    input_linear(x)`` (one [2 I, hidden] matrix, the gate's rows first), no biases:
    transformers' Granite MLP (``shared_mlp``) under its names."""

    def __init__(self, config, intermediate_size: int):
        super().__init__()
        dim = config.hidden_size
        self.input_linear = nn.Linear(dim, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)  # [..., I] each
        return self.output_linear(self.act_fn(gate) * up)

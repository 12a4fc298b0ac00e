"""Parameter and FLOP counts of a model family's config: the one home of this arithmetic
(training metrics' MFU, the planner's traffic and step time).

Counted from the modules themselves: one decoder layer and the embeddings are built on
the meta device (no memory) by the config's family, so every family's own parameters
(biases, per-head norms) are counted without a formula per family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from usp.models.family import decoder_layers, family_of


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of a config (elements, not bytes) and what its FLOPs need."""

    per_layer: int  # one decoder layer's parameters
    other: int  # embeddings, the final norm and an untied output projection
    layer_matmul: int  # one decoder layer's parameters that take part in a matmul per token
    head_matmul: int  # the output projection's (vocab x hidden)
    layers: int
    heads: int  # query heads
    head_dim: int

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.other

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul per token: the layers' projections and
        the output projection (the embedding lookup is not a matmul)."""
        return self.layers * self.layer_matmul + self.head_matmul

    def attention_flops(self, square_tokens: float) -> float:
        """Forward + backward FLOPs of causal attention over documents whose squared
        lengths sum to ``square_tokens``: per document of ``n`` tokens and layer,
        ``QK^T`` and ``PV`` cost ``2 * n^2 * head_dim`` each per head, half of it visible
        -> forward ``2 * n^2 * H * head_dim``, times 3 for forward + backward."""
        return 6 * self.layers * self.heads * self.head_dim * square_tokens

    def training_flops(self, document_lengths: list[int]) -> float:
        """Forward + backward FLOPs of one packed row (backward = 2x forward; activation
        recomputation is not counted, as usual for MFU): ``6 * matmul`` per token plus
        :meth:`attention_flops`."""
        tokens = sum(document_lengths)
        square = sum(n * n for n in document_lengths)
        return 6 * self.matmul * tokens + self.attention_flops(square)


def model_counts(config) -> ModelCounts:
    """The counts of ``config``'s family's model (one layer built on the meta device)."""
    with torch.device("meta"):
        model = family_of(config).build(config.replace(num_hidden_layers=1))
    layer = decoder_layers(model)[0]
    per_layer = sum(p.numel() for p in layer.parameters())
    layer_matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
    total = sum(p.numel() for p in model.parameters())
    return ModelCounts(
        per_layer=per_layer,
        other=total - per_layer,
        layer_matmul=layer_matmul,
        head_matmul=config.hidden_size * config.vocab_size,
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        head_dim=config.attention_head_dim,
    )


def training_flops(config, document_lengths: list[int]) -> float:
    """:meth:`ModelCounts.training_flops` of ``config``."""
    return model_counts(config).training_flops(document_lengths)

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
from usp.models.mixers import ATTENTION, MIXER_OF_KIND, MIXERS
from usp.sp.assignment import DocumentCost


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of a config (elements, not bytes) and what its FLOPs need. Layers
    that differ (dense and mixture-of-experts layers) are counted each as it is; the
    per-layer fields are then means over the layers."""

    per_layer: int  # one decoder layer's parameters
    other: int  # embeddings, the final norm and an untied output projection
    layer_matmul: int  # one decoder layer's parameters that take part in a matmul per token
    head_matmul: int  # the output projection's (vocab x hidden)
    layers: int
    heads: int  # query heads
    head_dim: int
    experts: int = 0  # every expert's parameters, all layers (mixture-of-experts models)
    routed: int = 0  # the parameters of the experts one token is routed to, all layers
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (empty: all full)
    attention_layers: int | None = None  # layers with softmax attention (None: every layer)
    #: forward FLOPs per token of the linear-attention layers' recurrences, all such layers
    #: together (each mixer's ``flops_per_token``: :mod:`usp.models.mixers`; 0 without them)
    linear_flops_per_token: int = 0

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.other

    @property
    def active(self) -> int:
        """Parameters one token uses: :attr:`total` less the experts it is not routed to
        (equal to :attr:`total` for a dense model)."""
        return self.total - self.experts + self.routed

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul per token: the layers' projections and
        the output projection (the embedding lookup is not a matmul)."""
        return self.layers * self.layer_matmul + self.head_matmul

    def attention_flops(self, square_tokens: float) -> float:
        """Forward + backward FLOPs of causal attention over documents whose squared
        lengths sum to ``square_tokens``: per document of ``n`` tokens and layer,
        ``QK^T`` and ``PV`` cost ``2 * n^2 * head_dim`` each per head, half of it visible
        -> forward ``2 * n^2 * H * head_dim``, times 3 for forward + backward; only on
        the layers with softmax attention (a hybrid's linear-attention layers are linear
        in ``n``: :attr:`linear_flops_per_token`)."""
        layers = self.layers if self.attention_layers is None else self.attention_layers
        return 6 * layers * self.heads * self.head_dim * square_tokens

    def attention_square(self, document_lengths: list[int]) -> float:
        """What :meth:`attention_flops` takes for these documents: the sum of their
        squared lengths, or with sliding layers the mean over the layers of what each
        sees (:func:`_window_square`)."""
        if any(w is not None for w in self.windows):
            return sum(_window_square(document_lengths, w) for w in self.windows) / self.layers
        return sum(n * n for n in document_lengths)

    def training_flops(self, document_lengths: list[int]) -> float:
        """Forward + backward FLOPs of one packed row (backward = 2x forward; activation
        recomputation is not counted, as usual for MFU): ``6 * matmul`` per token plus
        :meth:`attention_flops`."""
        tokens = sum(document_lengths)
        square = self.attention_square(document_lengths)
        linear = 3 * self.linear_flops_per_token * tokens
        return 6 * self.matmul * tokens + self.attention_flops(square) + linear

    def document_cost(self) -> DocumentCost:
        """What ``placement="documents"`` balances for this model
        (:class:`usp.sp.assignment.DocumentCost`), in the units of
        :meth:`training_flops`: ``6 * matmul`` + 3x the linear-attention recurrence per
        token; per (query, key) pair and softmax-attention layer ``12 * H * head_dim``
        (:meth:`attention_flops` counts ``n^2`` for the ``n^2 / 2`` pairs), grouped by
        sliding window; a split document's recurrence once more per token on a ring (its
        state pass adds d_k value columns: about 2x the kernel for d_k = d_v)."""
        per_pair = 12 * self.heads * self.head_dim
        if self.windows:
            groups: dict[int | None, int] = {}
            for window in self.windows:
                groups[window] = groups.get(window, 0) + 1
            attention = tuple((w, per_pair * n) for w, n in groups.items())
        else:
            layers = self.layers if self.attention_layers is None else self.attention_layers
            attention = ((None, per_pair * layers),) if layers else ()
        linear = 3 * self.linear_flops_per_token
        return DocumentCost(
            token_flops=6 * self.matmul + linear, attention=attention, linear_ring_flops=linear
        )


def _window_square(lengths: list[int], window: int | None) -> int:
    """What ``n^2`` stands for in :meth:`ModelCounts.attention_flops` (twice the visible
    (query, key) pairs) in a layer sliding over ``window`` keys: ``n^2`` for a document
    within the window, else ``2 * (window (window + 1) / 2 + (n - window) window)``."""
    if window is None:
        return sum(n * n for n in lengths)
    return sum(n * n if n <= window else 2 * n * window - window * window + window for n in lengths)


def model_counts(config) -> ModelCounts:
    """The counts of ``config``'s family's model: one layer of each kind
    (``config.layer_variants()``) built on the meta device."""
    family = family_of(config)
    per_layer = matmul = experts = routed = other = 0
    for variant, repeats in config.layer_variants():
        with torch.device("meta"):
            model = family.build(variant)
        layer = decoder_layers(model)[0]
        per_layer += repeats * sum(p.numel() for p in layer.parameters())
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                matmul += repeats * module.weight.numel()
            elif hasattr(module, "matmul_parameters"):  # a router, grouped experts
                matmul += repeats * module.matmul_parameters()
            if hasattr(module, "top_k") and hasattr(module, "gate_up_proj"):  # experts
                experts += repeats * sum(p.numel() for p in module.parameters())
                routed += repeats * getattr(module, "routed_parameters", module.matmul_parameters)()
        other = sum(p.numel() for p in model.parameters()) - sum(
            p.numel() for p in layer.parameters()
        )
    layers = config.num_hidden_layers
    windows = tuple(config.layer_window(i) for i in range(layers))
    mixers = [MIXER_OF_KIND[kind] for kind in config.layer_kinds]  # each layer's
    attention = [m for m in mixers if m == ATTENTION]
    return ModelCounts(
        per_layer=per_layer // layers,
        other=other + per_layer % layers,  # the total stays exact
        layer_matmul=round(matmul / layers),
        head_matmul=config.hidden_size * config.vocab_size,
        layers=layers,
        heads=config.num_attention_heads,
        head_dim=config.attention_head_dim,
        experts=experts,
        routed=routed,
        windows=windows if any(w is not None for w in windows) else (),
        attention_layers=None if len(attention) == layers else len(attention),
        linear_flops_per_token=sum(
            MIXERS[m].flops_per_token(config) for m in mixers if MIXERS[m].flops_per_token
        ),
    )


def document_cost(config) -> DocumentCost:
    """:meth:`ModelCounts.document_cost` of ``config``: pass it to
    ``usp.Plan(..., placement="documents", placement_cost=...)``."""
    return model_counts(config).document_cost()


def training_flops(config, document_lengths: list[int]) -> float:
    """:meth:`ModelCounts.training_flops` of ``config``."""
    return model_counts(config).training_flops(document_lengths)

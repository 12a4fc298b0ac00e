"""The one decoder stack every family is built from (HF's ``model.`` prefix): the
embedding, the decoder layers, the final norm.

A layer is a token mixer and an MLP (:class:`usp.models.parts.LayerParts`), each after
its norm and added to the residual; the family's :class:`usp.models.parts.Blueprint`
says which norm, whether each sub-block's output is normed too (Gemma 3's sandwich),
whether the embedding is scaled, whether the config's muP multipliers apply (Granite) and
the MLP's attribute. The stack computes each distinct RoPE once per forward and hands
each layer its own; a mixture-of-experts MLP's router statistics ride along
with the hidden states and are summed over the layers.

Architecture only: a layer's one distributed call is its mixer's (``plan.attention``,
the Gated DeltaNet ring); everything else is token-local.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from usp.models.mixers import MIXERS
from usp.models.moe import add_router_stats, split_layer_output
from usp.models.parts import Blueprint, LayerParts
from usp.models.rope import attention_factor, inverse_frequencies, rope_cos_sin


class DecoderLayer(nn.Module):
    """x [B, S/P, dim] -> [B, S/P, dim]; with a mixture-of-experts MLP ``(x, its router
    statistics [2E + 1])`` (:func:`usp.models.moe.split_layer_output`)."""

    def __init__(self, config, plan, parts: LayerParts, blueprint: Blueprint):
        super().__init__()
        mixer = MIXERS[parts.mixer]

        def norm() -> nn.Module:
            return blueprint.norm(config.hidden_size, config.rms_norm_eps)

        self.input_layernorm = norm()
        setattr(self, mixer.attribute, mixer.build(config, plan, parts, blueprint.norm))
        self.post_attention_layernorm = norm()
        self.sandwich = blueprint.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        #: the MLP's attribute (transformers' name: ``mlp``, Granite's ``shared_mlp``)
        self.mlp_attribute = blueprint.mlp_attribute
        setattr(self, self.mlp_attribute, parts.mlp)
        if self.sandwich:
            self.post_feedforward_layernorm = norm()
        #: each sub-block's output times this before the residual (muP; None: 1)
        self.residual_multiplier = config.residual_multiplier if blueprint.mup_multipliers else None
        #: the mixer's name in usp.models.mixers.MIXERS, the attribute holding it
        self.mixer_name, self.mixer_attribute = parts.mixer, mixer.attribute
        self.mixer_uses_rope = mixer.uses_rope

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_attribute)

    @property
    def mlp(self) -> nn.Module:
        return self._modules[self.mlp_attribute]

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier is None else h * self.residual_multiplier

    def forward(self, x, cos=None, sin=None, packed=None):
        h = self.input_layernorm(x)
        h = (
            self.mixer(h, cos, sin, packed)
            if self.mixer_uses_rope
            else self.mixer(h, packed=packed)
        )
        if self.sandwich:  # each sub-block's output normed before the residual
            x = x + self.post_attention_layernorm(h)
            h = self.pre_feedforward_layernorm(x)
        else:
            x = x + self._scaled(h)
            h = self.post_attention_layernorm(x)
        out, stats = split_layer_output(self.mlp(h))
        if self.sandwich:
            out = self.post_feedforward_layernorm(out)
        x = x + self._scaled(out)
        return x if stats is None else (x, stats)


def pad_row_embedding(config) -> nn.Embedding:
    """The input embedding with transformers' ``padding_idx``: the pad token's row gets no
    gradient from the input side (a pad id outside the vocabulary, or none, gives a plain
    embedding)."""
    pad = config.pad_token_id
    pad = pad if isinstance(pad, int) and not isinstance(pad, bool) else None
    pad = pad if pad is not None and 0 <= pad < config.vocab_size else None
    return nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=pad)


class DecoderStack(nn.Module):
    """Embeddings, decoder layers (``layers[i]`` built from ``parts[i]``) and the final
    norm."""

    def __init__(self, config, plan, parts: list[LayerParts], blueprint: Blueprint):
        super().__init__()
        self.config = config
        self.plan = plan
        self.embed_tokens = pad_row_embedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, plan, p, blueprint) for p in parts)
        self.norm = blueprint.norm(config.hidden_size, config.rms_norm_eps)
        self.embedding_scale = math.sqrt(config.hidden_size) if blueprint.scaled_embedding else None
        #: muP (Granite): the embedding's multiplier and the logits' divisor (None: none)
        mup = blueprint.mup_multipliers
        self.embedding_multiplier = config.embedding_multiplier if mup else None
        self.logits_scaling = config.logits_scaling if mup else None
        #: the distinct RoPE settings, and each layer's index among them (None: no RoPE)
        self.ropes = []
        for p in parts:
            if p.rope is not None and p.rope not in self.ropes:
                self.ropes.append(p.rope)
        self.rope_of_layer = [None if p.rope is None else self.ropes.index(p.rope) for p in parts]

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed=None, router_stats=None
    ):
        """input_ids [B, S/P], position_ids [S/P] or [B, S/P] -> hidden [B, S/P, dim]: the
        final norm's output (divided by ``logits_scaling`` under muP: what the output
        projection turns into the logits).
        ``router_stats``: a list that receives the sum of the MoE layers' router
        statistics ([2E + 1], :func:`usp.models.moe.router_stats`), if any layer has
        experts."""
        x = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:  # rounded to the model's dtype, as HF holds it
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype, device=x.device)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        if position_ids.dim() == 1:
            position_ids = position_ids[None]  # [1, S/P]: the same positions in every row
        tables = [
            rope_cos_sin(
                position_ids,
                inverse_frequencies(rope, device=x.device),
                x.dtype,
                attention_factor(rope),
            )  # fmt: skip  ([B or 1, S/P, rotary dims] each)
            for rope in self.ropes
        ]
        total = None
        for layer, rope in zip(self.layers, self.rope_of_layer):
            cos, sin = (None, None) if rope is None else tables[rope]
            x, stats = split_layer_output(layer(x, cos, sin, packed))
            total = add_router_stats(total, stats)
        if router_stats is not None and total is not None:
            router_stats.append(total)
        x = self.norm(x)
        return x if self.logits_scaling is None else x / self.logits_scaling

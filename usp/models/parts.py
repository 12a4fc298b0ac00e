"""The vocabulary a family names its model in: the stack's shared choices
(:class:`Blueprint`) and one decoder layer's parts (:class:`LayerParts`).

The stack (:mod:`usp.models.stack`) builds every family from these; a family
(``usp/models/<family>.py``) says which it takes and holds no forward of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from usp.models.attention import AttentionOptions
from usp.models.norm import RMSNorm
from usp.models.rope_config import RopeSettings


@dataclass(frozen=True)
class Blueprint:
    """What every layer of a family's stack shares.

    * ``norm``: the class of every norm (the layers', q/k's, the final one):
      :class:`usp.models.norm.RMSNorm` or ``ZeroCentredRMSNorm`` (``1 + weight``);
    * ``sandwich_norms``: each sub-block's output normed before it joins the residual,
      four norms a layer (Gemma 3: ``input_layernorm``, ``post_attention_layernorm``,
      ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); False: pre-norms
      only (``input_layernorm``, ``post_attention_layernorm`` before the MLP);
    * ``scaled_embedding``: the embedding times ``sqrt(hidden_size)`` rounded to the
      model's dtype (Gemma 3);
    * ``mup_multipliers``: the config's muP multipliers (Granite): the embedding times
      ``embedding_multiplier``, each sub-block's output times ``residual_multiplier``
      before the residual, the final hidden states divided by ``logits_scaling`` (the
      logits' divisor, applied before the output projection);
    * ``mlp_attribute``: the layer's attribute holding its MLP (``mlp``; Granite:
      ``shared_mlp``).
    """

    norm: type[nn.Module] = RMSNorm
    sandwich_norms: bool = False
    scaled_embedding: bool = False
    mup_multipliers: bool = False
    mlp_attribute: str = "mlp"


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's parts.

    * ``mlp``: the MLP part, built (:class:`usp.models.mlp.MLP`, a
      :class:`usp.models.moe.SparseMoE`, ...);
    * ``mixer``: the token mixer's name in :data:`usp.models.mixers.MIXERS`;
    * ``attention``, ``window``: an attention mixer's options and sliding window (None:
      full causal);
    * ``rope``: the rotation the mixer applies (None: a mixer without RoPE).
    """

    mlp: nn.Module
    mixer: str = "attention"
    attention: AttentionOptions = field(default_factory=AttentionOptions)
    window: int | None = None
    rope: RopeSettings | None = None

"""The token mixers a decoder layer can hold, and the layer kinds each computes.

A :class:`MixerPart` says how one kind of token mixer enters the stack: the layer's
attribute for it (transformers' name), how it is built, whether it takes RoPE, and what
it checks, refuses, initialises and costs. :data:`MIXER_OF_KIND` maps each of
transformers' layer kinds (``config.layer_kinds``) to its mixer.

Adding a mixer (Mamba-2, ...) is its own small module (as :mod:`usp.models.gated_deltanet`)
plus one :data:`MIXERS` entry and the kind it serves in :data:`MIXER_OF_KIND`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from usp.models import gated_deltanet, mamba2
from usp.models.attention import Attention
from usp.models.layer_kinds import FULL, LINEAR, MAMBA, SLIDING
from usp.models.parts import LayerParts


@dataclass(frozen=True)
class MixerPart:
    """One kind of token mixer.

    * ``attribute``: the layer's attribute holding it (``self_attn``, ``linear_attn``,
      ``mamba``);
    * ``build(config, plan, parts, norm)``: the module, ``x [B, S/P, dim] -> [B, S/P,
      dim]``, called ``mixer(x, cos, sin, packed)`` with ``uses_rope``, else
      ``mixer(x, packed=packed)``;
    * ``check(plan, config)``: a refusal at model construction (heads the Ulysses degree
      cannot split), before any collective;
    * ``kernel_refusal(config, plan, device, dtype)``: why a kernel the plan forces cannot
      run it (None: it can);
    * ``init_weights(module, std, generator)``: after the stack's own initialisation;
    * ``flops_per_token(config)``: its forward FLOPs per token beyond its projections'
      (None: softmax attention, counted by :mod:`usp.models.counts` per document).
    """

    attribute: str
    build: Callable[..., nn.Module]
    uses_rope: bool = True
    check: Callable | None = None
    kernel_refusal: Callable | None = None
    init_weights: Callable | None = None
    flops_per_token: Callable | None = None


def _attention(config, plan, parts: LayerParts, norm) -> Attention:
    return Attention(config, plan, parts.attention, parts.window, norm)


def _gated_deltanet(config, plan, parts: LayerParts, norm) -> nn.Module:
    return gated_deltanet.build(config, plan)


def _mamba2(config, plan, parts: LayerParts, norm) -> nn.Module:
    return mamba2.build(config, plan)


ATTENTION, GATED_DELTANET, MAMBA2 = "attention", "gated_deltanet", "mamba2"
MIXERS: dict[str, MixerPart] = {
    ATTENTION: MixerPart("self_attn", _attention),
    GATED_DELTANET: MixerPart(
        "linear_attn",
        _gated_deltanet,
        uses_rope=False,
        check=gated_deltanet.check_linear_heads,
        kernel_refusal=gated_deltanet.kernel_refusal,
        init_weights=gated_deltanet.init_weights,
        flops_per_token=gated_deltanet.flops_per_token,
    ),
    MAMBA2: MixerPart(
        "mamba",
        _mamba2,
        uses_rope=False,
        check=mamba2.check_heads,
        kernel_refusal=mamba2.kernel_refusal,
        init_weights=mamba2.init_weights,
        flops_per_token=mamba2.flops_per_token,
    ),
}
#: transformers' layer kinds and the mixer that computes each
MIXER_OF_KIND: dict[str, str] = {
    FULL: ATTENTION, SLIDING: ATTENTION, LINEAR: GATED_DELTANET, MAMBA: MAMBA2,
}  # fmt: skip


def mixers_of(config) -> list[MixerPart]:
    """The mixer parts ``config``'s layers use, each once, in order of first use."""
    names = dict.fromkeys(MIXER_OF_KIND[kind] for kind in config.layer_kinds)
    return [MIXERS[name] for name in names]

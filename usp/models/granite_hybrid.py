"""The Granite 4 hybrid family (``GraniteMoeHybridForCausalLM``, model_type
``granitemoehybrid``: IBM's Granite-4.0-H models), dense form, as transformers 5.25
computes it: the stack with RMSNorm, per-layer token mixers (``layer_types``: Mamba-2,
:mod:`usp.models.mamba2`, exact under Ulysses x ring; or causal attention, GQA with
``attention_multiplier`` as its softmax scale and RoPE only with
``position_embedding_type = "rope"``, none with ``"nope"`` or null) and on every layer the
shared SwiGLU MLP (``shared_mlp``: ``input_linear`` holds gate and up); the muP
multipliers: the embedding times ``embedding_multiplier``, each sub-block's output times
``residual_multiplier`` before the residual, the logits divided by ``logits_scaling``.

``layer_types`` is read in either naming (``mamba`` / ``attention``, transformers 5's
``linear_attention`` / ``full_attention``; ``layers_block_type``), written in 5's. Refused
by name: the MoE form (``num_local_experts`` > 0: H-Tiny, H-Small), another activation,
``attention_dropout``, another ``position_embedding_type``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from usp.errors import ModelConfigError
from usp.models import mamba2
from usp.models.attention import AttentionOptions
from usp.models.config import (
    DecoderConfig,
    check_integers,
    check_numbers,
    hf_float,
    merge_alias,
    read_hf_float,
)  # fmt: skip
from usp.models.decoder import CausalLM
from usp.models.layer_kinds import FULL, LINEAR, MAMBA, LayerTypes
from usp.models.mlp import FusedGatedMLP
from usp.models.parts import Blueprint
from usp.models.rope_config import RopeSettings

#: layer_types as config.json files write them -> usp's kinds (and back, transformers 5's)
KIND_OF = {"mamba": MAMBA, LINEAR: MAMBA, "attention": FULL, FULL: FULL}
WRITTEN = {MAMBA: LINEAR, FULL: FULL}
MUP_FIELDS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
              "logits_scaling")  # fmt: skip
POSITION_TYPES = (None, "nope", "rope")


@dataclass(frozen=True)
class GraniteHybridConfig(LayerTypes, DecoderConfig):
    """Granite 4 hybrid hyper-parameters (HF ``config.json`` names; the defaults are
    transformers' ``GraniteMoeHybridConfig``'s but ``num_local_experts``, 0 here).
    ``mamba_d_head="auto"``: ``mamba_expand * hidden_size // mamba_n_heads``."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: int | list[int] | None = 1
    eos_token_id: int | list[int] | None = 2
    attention_bias: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    num_local_experts: int = 0
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    family: ClassVar[str] = "granitemoehybrid"
    architectures: ClassVar[tuple[str, ...]] = ("GraniteMoeHybridForCausalLM",)
    model_type: ClassVar[str] = "granitemoehybrid"
    #: transformers' default for a config.json without the key: the MoE form (refused)
    hf_defaults: ClassVar[dict[str, Any]] = {"num_local_experts": 8}
    known_kinds: ClassVar[tuple[str, ...]] = (MAMBA, FULL)
    shape_fields: ClassVar[tuple[str, ...]] = (
        "attention_bias", "layer_types", "shared_intermediate_size", *mamba2.SHAPE_FIELDS,
    )  # fmt: skip

    @classmethod
    def pattern_layer_types(cls, layers: int, pattern: int) -> tuple[str, ...]:
        return (MAMBA,) * layers  # (transformers' default: every layer Mamba-2)

    def __post_init__(self) -> None:
        if self.num_local_experts != 0:
            raise ModelConfigError(
                f"num_local_experts={self.num_local_experts!r}: usp's granitemoehybrid family "
                "computes the dense form only (num_local_experts 0: Granite-4.0-H-Micro, "
                "H-1B, H-350M), not the mixture of experts of H-Tiny / H-Small; train those "
                "through transformers' own model with usp.models.hf.swap_linear_attention and "
                "usp.models.hf.register (their Mamba-2 layers exact under SP)"
            )
        super().__post_init__()
        object.__setattr__(self, "head_dim", self.attention_head_dim)  # (as written back)
        mamba2.check_config(self)
        check_integers(self, {"shared_intermediate_size": 1})
        check_numbers(self, MUP_FIELDS, positive=True)
        if self.position_embedding_type not in POSITION_TYPES:
            raise ModelConfigError(
                f"position_embedding_type={self.position_embedding_type!r} is not a Granite "
                "setting; give 'rope', 'nope' or null (no RoPE)"
            )

    def layer_rope(self, index: int) -> RopeSettings | None:
        """RoPE over each head's dims with ``position_embedding_type = "rope"``; None
        (attention without positions) otherwise."""
        return super().layer_rope(index) if self.position_embedding_type == "rope" else None

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        """``layer_types`` (or its alias ``layers_block_type``) in either naming."""
        if not cls.accepts(config):
            return super().from_hf_dict(config, source=source)  # its error
        config = dict(config)
        merge_alias(config, "layer_types", "layers_block_type", source=source)
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = [KIND_OF.get(kind, kind) for kind in config["layer_types"]]
        if isinstance(config.get("time_step_limit"), list):
            config["time_step_limit"] = [read_hf_float(v) for v in config["time_step_limit"]]
        return super().from_hf_dict(config, source=source)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        out = super().to_hf_dict(dtype=dtype)
        out["layer_types"] = [WRITTEN[kind] for kind in self.layer_types]
        out["time_step_limit"] = [hf_float(v) for v in self.time_step_limit]
        return out


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=4, layer_types=(MAMBA, MAMBA, FULL, MAMBA),
             shared_intermediate_size=128, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
             mamba_d_head=32, max_position_embeddings=65536, tie_word_embeddings=True,
             position_embedding_type="nope", embedding_multiplier=12.0, residual_multiplier=0.22,
             attention_multiplier=0.0625, logits_scaling=8.0)  # fmt: skip
_PUBLISHED = dict(vocab_size=100352, tie_word_embeddings=True, position_embedding_type="nope",
                  rms_norm_eps=1e-5, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                  embedding_multiplier=12.0)  # fmt: skip


def _kinds(layers: int, attention: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(FULL if i in attention else MAMBA for i in range(layers))


_H_350M = dict(hidden_size=768, intermediate_size=2048, shared_intermediate_size=2048,
               num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4,
               mamba_n_heads=48, mamba_d_head=32, layer_types=_kinds(32, (10, 13, 17, 27)),
               max_position_embeddings=32768, residual_multiplier=0.246,
               attention_multiplier=0.015625, logits_scaling=3.0)  # fmt: skip
_H_MICRO = dict(hidden_size=2048, intermediate_size=8192, shared_intermediate_size=8192,
                num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                mamba_n_heads=64, mamba_d_head=64, layer_types=_kinds(40, (5, 15, 25, 35)),
                max_position_embeddings=131072, residual_multiplier=0.22,
                attention_multiplier=0.0078125, logits_scaling=8.0)  # fmt: skip


#: shapes of IBM's dense Granite-4.0-H models and a tiny one for tests and demos. Not
#: checked against the hub's config.json files (offline here): H-350M as a third party's
#: copy of its config.json states it; H-Micro's geometry and attention layers likewise,
#: its multipliers those of Granite 4's 1B-class models (they change no shape)
PRESETS: dict[str, GraniteHybridConfig] = {
    "granite-4.0-h-350m": GraniteHybridConfig(**_PUBLISHED, **_H_350M),
    "granite-4.0-h-micro": GraniteHybridConfig(**_PUBLISHED, **_H_MICRO),
    # byte vocabulary; 4 layers (Mamba-2, Mamba-2, attention, Mamba-2), 4 Mamba-2 heads of
    # 32 in 2 B/C groups, no RoPE, muP multipliers away from 1, tied
    "granite4h-tiny": GraniteHybridConfig(**_TINY),
}


class GraniteHybrid(CausalLM):
    """A Granite 4 hybrid causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = GraniteHybridConfig
    presets = PRESETS
    blueprint = Blueprint(mup_multipliers=True, mlp_attribute="shared_mlp")
    #: LoRA's default targets (usp.models.lora.default_targets): attention and the MLP
    lora_default_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "input_linear",
                            "output_linear")  # fmt: skip
    compile_refusal = ("its Mamba-2 layers run eagerly only (usp.linear.mamba2_usp is refused "
                       "under torch.compile)")  # fmt: skip

    @staticmethod
    def attention_options(config: GraniteHybridConfig) -> AttentionOptions:
        bias = bool(config.attention_bias)
        return AttentionOptions(qkv_bias=bias, o_bias=bias,
                                softmax_scale=config.attention_multiplier)  # fmt: skip

    @staticmethod
    def make_mlp(config: GraniteHybridConfig, index: int) -> nn.Module:
        return FusedGatedMLP(config, config.shared_intermediate_size)

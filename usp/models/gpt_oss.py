"""The gpt-oss family (``GptOssForCausalLM``, transformers 5's layout): the stack with
biases on q/k/v/o, one learned sink logit per query head (``sinks``), per-layer kinds
from ``layer_types`` (``sliding_attention`` over ``sliding_window`` keys,
``full_attention``; by default alternating, sliding first), both exact under Ulysses x
ring at any length; YaRN RoPE (the published factor 32 over 4096 positions, ``truncate:
false``; a config.json naming none gets it, as transformers' class does); and a
mixture of experts on every layer (:mod:`usp.models.gpt_oss_experts`: a router with
bias, experts with biases and a clamped SwiGLU, in transformers' grouped layout). With
``output_router_logits`` the training loss adds ``router_aux_loss_coef`` times the
load-balancing loss, exact under SP.

The published ``openai/gpt-oss-*`` checkpoints hold the experts MXFP4-quantized; they are
refused with what to do (dequantize once with transformers). RMSNorm: transformers keeps
gpt-oss's norm weights in float32 and multiplies before casting; usp multiplies in the
model's dtype (equal in float32/float64, within bf16 rounding in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from usp.errors import ModelConfigError
from usp.models.attention import AttentionOptions
from usp.models.config import (
    DecoderConfig,
    check_integers,
    check_numbers,
    check_routing,
    merge_alias,
)
from usp.models.decoder import CausalLM
from usp.models.gpt_oss_experts import GptOssMoE
from usp.models.layer_kinds import FULL, SLIDING, LayerTypes

#: transformers' gpt-oss RoPE for a config.json that names none (the published one)
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
#: transformers' GptOssConfig ``default_theta``
GPT_OSS_THETA = 150000.0

#: transformers' GptOssConfig defaults for keys a config.json leaves out
GPT_OSS_HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
}


@dataclass(frozen=True)
class GptOssConfig(LayerTypes, DecoderConfig):
    """gpt-oss hyper-parameters (HF ``config.json`` names; ``num_experts`` is read as
    transformers' alias of ``num_local_experts``). ``layer_types=None``: alternating,
    sliding first."""

    rms_norm_eps: float = 1e-5
    rope_theta: float = GPT_OSS_THETA
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(GPT_OSS_ROPE))
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    sliding_window: int | None = 128
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    family: ClassVar[str] = "gpt_oss"
    architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    model_type: ClassVar[str] = "gpt_oss"
    hf_defaults: ClassVar[dict[str, Any]] = GPT_OSS_HF_DEFAULTS
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias", "num_local_experts")

    @classmethod
    def default_layer_types(cls, layers: int) -> tuple[str, ...]:
        """transformers' rule: even layers slide, odd layers attend to everything."""
        return tuple((SLIDING, FULL)[i % 2] for i in range(layers))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_integers(self, {"num_local_experts": 1, "num_experts_per_tok": 1})
        check_routing(self, "num_local_experts")
        check_numbers(self, ("swiglu_alpha", "swiglu_limit"))

    @property
    def num_experts(self) -> int:
        """transformers' alias of ``num_local_experts`` (what the aux loss divides by)."""
        return self.num_local_experts

    @classmethod
    def check_hf(cls, config: dict[str, Any], source: str) -> None:
        quant = config.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ModelConfigError(
                f"{source}: the weights are quantized (quantization_config quant_method "
                f"{method!r}: the published openai/gpt-oss checkpoints hold their experts in "
                "MXFP4); usp trains unquantized weights. Dequantize once with transformers: "
                "GptOssForCausalLM.from_pretrained(path, quantization_config="
                "Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(out) "
                "(or use a bf16 copy of the checkpoint); `usp plan` can take the preset "
                "gpt-oss-20b / gpt-oss-120b"
            )

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        config = dict(config)
        # transformers' attribute_map alias
        merge_alias(config, "num_local_experts", "num_experts", source=source)
        if config.get("layer_types") is None:
            config.pop("layer_types", None)
        # as transformers' class: no RoPE given is the published YaRN with theta 150000
        if not config.get("rope_parameters") and not config.get("rope_scaling"):
            config.pop("rope_parameters", None)
            config["rope_scaling"] = dict(GPT_OSS_ROPE)
        params = config.get("rope_parameters") or {}
        if "rope_theta" not in params:
            config.setdefault("rope_theta", GPT_OSS_THETA)
        return super().from_hf_dict(config, source=source)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        out = super().to_hf_dict(dtype=dtype)
        if self.rope_scaling is None:  # plain RoPE, explicitly (no key means YaRN here)
            if "rope_parameters" in out:
                out["rope_parameters"] = {**out["rope_parameters"], "rope_type": "default"}
            else:
                out["rope_scaling"] = {"rope_type": "default"}
        return out


# ---------------------------------------------------------------------- presets
#: published shapes (config.json of openai/gpt-oss-20b and openai/gpt-oss-120b) and a
#: tiny one for tests and demos
_PUBLISHED = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_experts_per_tok=4,
    sliding_window=128,
    router_aux_loss_coef=0.9,
    eos_token_id=200002,
    pad_token_id=199999,
)
PRESETS: dict[str, GptOssConfig] = {
    "gpt-oss-20b": GptOssConfig(**_PUBLISHED, num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": GptOssConfig(**_PUBLISHED, num_hidden_layers=36, num_local_experts=128),
    # byte vocabulary; 8 experts, top-2, window 16, the load-balancing loss on
    "gpt-oss-tiny": GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
}


class GptOss(CausalLM):
    """A gpt-oss causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = GptOssConfig
    presets = PRESETS

    @staticmethod
    def attention_options(config: GptOssConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sinks=True)

    @staticmethod
    def make_mlp(config: GptOssConfig, index: int) -> GptOssMoE:
        return GptOssMoE(config)

"""The Qwen3.5-MoE text family (``Qwen3_5MoeForCausalLM``; the language model of
``Qwen3_5MoeForConditionalGeneration`` checkpoints): Qwen3.5's layers
(:mod:`usp.models.qwen3_5`: Gated DeltaNet and gated full attention) with a
mixture-of-experts MLP on every layer, as transformers' ``Qwen3_5MoeSparseMoeBlock``:
a softmax router whose top-k weights are always renormalised, grouped SwiGLU experts of
``moe_intermediate_size`` and a shared SwiGLU expert of
``shared_expert_intermediate_size`` gated per token by ``sigmoid(shared_expert_gate(x))``
(:class:`usp.models.moe.SparseMoE`). With ``output_router_logits`` the training loss adds
``router_aux_loss_coef`` times the load-balancing loss, exact under SP.

transformers' config has no dense ``intermediate_size``: usp keeps the field (every
config has one) equal to ``moe_intermediate_size`` and does not write it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from usp.models.config import check_integers, check_routing
from usp.models.layer_kinds import FULL, LINEAR
from usp.models.mlp import MLP
from usp.models.moe import SparseMoE
from usp.models.qwen3_5 import QWEN3_5_HF_DEFAULTS, Qwen3_5, Qwen3_5Config

#: transformers' Qwen3_5MoeTextConfig defaults (5.24) for keys a config.json leaves out
QWEN3_5_MOE_HF_DEFAULTS: dict[str, Any] = {
    **QWEN3_5_HF_DEFAULTS,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 256,
    "num_experts_per_tok": 8,
}
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
}


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Qwen3.5-MoE hyper-parameters (HF ``config.json`` names)."""

    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    family: ClassVar[str] = "qwen3_5_moe"
    architectures: ClassVar[tuple[str, ...]] = (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    )
    model_type: ClassVar[str] = "qwen3_5_moe_text"
    multimodal_type: ClassVar[str] = "qwen3_5_moe"
    hf_defaults: ClassVar[dict[str, Any]] = QWEN3_5_MOE_HF_DEFAULTS
    text_defaults: ClassVar[dict[str, Any]] = TEXT_DEFAULTS
    shape_fields: ClassVar[tuple[str, ...]] = (
        *Qwen3_5Config.shape_fields,
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_experts",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_integers(self, dict.fromkeys(("moe_intermediate_size", "num_experts",
            "shared_expert_intermediate_size", "num_experts_per_tok"), 1))  # fmt: skip
        check_routing(self)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> Qwen3_5Config:
        if not cls.accepts(config):
            return super().from_hf_dict(config, source=source)  # its error
        config = cls.text_dict(config, source)
        moe = config.get("moe_intermediate_size", cls.hf_defaults["moe_intermediate_size"])
        config.setdefault("intermediate_size", moe)  # (not an HF key here; see module doc)
        return super().from_hf_dict(config, source=source)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        out = super().to_hf_dict(dtype=dtype)
        if self.intermediate_size == self.moe_intermediate_size:
            out.pop("intermediate_size")
        return out


#: transformers' Qwen3_5MoeTextConfig defaults, which its docstring calls "Qwen3.5-35B-A3B
#: style" (not checked against the hub's config.json: offline here), and a tiny one
PRESETS: dict[str, Qwen3_5MoeConfig] = {
    "qwen3.5-35b-a3b": Qwen3_5MoeConfig(
        **TEXT_DEFAULTS,
        **{k: v for k, v in QWEN3_5_MOE_HF_DEFAULTS.items() if k != "max_position_embeddings"},
        intermediate_size=512,
        max_position_embeddings=262_144,
    ),
    # byte vocabulary; 4 layers (linear, linear, full, linear), 8 experts, top-2, a shared
    # expert, the load-balancing loss on
    "qwen3.5-moe-tiny": Qwen3_5MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=(LINEAR, LINEAR, FULL, LINEAR),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=65536,
    ),
}


class Qwen3_5Moe(Qwen3_5):
    """A Qwen3.5-MoE causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Qwen3_5MoeConfig
    presets = PRESETS

    @staticmethod
    def make_mlp(config: Qwen3_5MoeConfig, index: int) -> SparseMoE:
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            True,  # transformers' Qwen3.5-MoE router always renormalises the top-k weights
            shared_expert=MLP(config, config.shared_expert_intermediate_size),
        )

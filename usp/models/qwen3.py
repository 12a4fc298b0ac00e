"""The Qwen3 family: the stack with a per-head RMSNorm of q and k before RoPE
(``q_norm``/``k_norm``, over ``head_dim``, which the config gives and which need not be
``hidden_size / heads``), as transformers' ``Qwen3Attention``; ``attention_bias`` on all
four projections; tied embeddings at small sizes; Qwen's sliding window
(:class:`usp.models.qwen2.QwenWindow`). The whole family is this file and its entry in
:data:`usp.models.family.FAMILIES`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from usp.models.attention import AttentionOptions
from usp.models.config import DecoderConfig
from usp.models.decoder import CausalLM
from usp.models.qwen2 import QWEN_HF_DEFAULTS, QwenWindow


@dataclass(frozen=True)
class Qwen3Config(QwenWindow, DecoderConfig):
    """Qwen3 hyper-parameters (HF ``config.json`` names; the sliding-window fields of
    :class:`usp.models.qwen2.QwenWindow`)."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False

    family: ClassVar[str] = "qwen3"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)
    model_type: ClassVar[str] = "qwen3"
    hf_defaults: ClassVar[dict[str, Any]] = {**QWEN_HF_DEFAULTS, "head_dim": 128}
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias",)


#: the published Qwen3-8B shape (config.json of Qwen/Qwen3-8B) and a tiny one for tests
PRESETS: dict[str, Qwen3Config] = {
    "qwen3-8b": Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # byte vocabulary; head_dim 32 != hidden / heads = 16; tied embeddings
    "qwen3-tiny": Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=65536,
    ),
}


class Qwen3(CausalLM):
    """A Qwen3 causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Qwen3Config
    presets = PRESETS

    @staticmethod
    def attention_options(config) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

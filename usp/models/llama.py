"""The Llama-3 family (Llama 3, 3.1, 3.2; GQA, RoPE with llama3 scaling, tied or untied
embeddings): the shared decoder of :mod:`usp.models.decoder` as it is, with Llama's
config.json names and its presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from usp.models.config import DecoderConfig
from usp.models.decoder import CausalLM


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Llama-3-family hyper-parameters (HF ``config.json`` names; see
    :class:`usp.models.config.DecoderConfig`). ``attention_bias``: a bias on q, k, v and
    the output projection, as transformers' ``LlamaAttention``."""

    attention_bias: bool = False

    family: ClassVar[str] = "llama"
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    model_type: ClassVar[str] = "llama"
    # transformers' LlamaConfig for keys a config.json leaves out
    hf_defaults: ClassVar[dict[str, Any]] = {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    hf_fixed: ClassVar[dict[str, Any]] = {
        **DecoderConfig.hf_fixed,
        "mlp_bias": False,
    }
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias",)


_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _llama31_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        **_LLAMA3_ROPE,
        "original_max_position_embeddings": 8192,
    }


_LLAMA3 = {"vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001}

#: the public Llama-3 shapes (for random-init runs, memory estimates and benchmarks; real
#: weights come from ``Llama.from_pretrained``) and a tiny one for CPU demos and tests
PRESETS: dict[str, LlamaConfig] = {
    # byte-level vocabulary (256), 4 query heads sharing 2 KV heads: GQA with KV
    # replication at ulysses=4, fast on CPU
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=65536,
    ),
    "llama3.2-1b": LlamaConfig(
        **_LLAMA3,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_scaling=_llama31_rope(32.0),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "llama3.2-3b": LlamaConfig(
        **_LLAMA3,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        rope_scaling=_llama31_rope(32.0),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "llama3.1-8b": LlamaConfig(
        **_LLAMA3,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_scaling=_llama31_rope(8.0),
        max_position_embeddings=131072,
    ),
    "llama3.1-70b": LlamaConfig(
        **_LLAMA3,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rope_scaling=_llama31_rope(8.0),
        max_position_embeddings=131072,
    ),
}


class Llama(CausalLM):
    """A Llama-3-family causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = LlamaConfig
    presets = PRESETS

"""Named model shapes: a tiny one for CPU demos and tests, and the public Llama-3 shapes
(for random-init runs, memory estimates and benchmarks; real weights come from
``Llama.from_pretrained``)."""

from __future__ import annotations

from usp.models.config import LlamaConfig

_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _llama31_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        **_LLAMA3_ROPE,
        "original_max_position_embeddings": 8192,
    }


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
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_scaling=_llama31_rope(32.0),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama3.2-3b": LlamaConfig(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        rope_scaling=_llama31_rope(32.0),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama3.1-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_scaling=_llama31_rope(8.0),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama3.1-70b": LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rope_scaling=_llama31_rope(8.0),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


def preset(name: str) -> LlamaConfig:
    """The named preset; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None

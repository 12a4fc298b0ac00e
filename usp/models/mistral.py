"""The Mistral family: the stack as Llama's, with Mistral's config.json names and its
``sliding_window`` on every layer (4096 in Mistral-7B v0.1, none from v0.2 on), computed
exactly by USP attention at any length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from usp.models.config import DecoderConfig
from usp.models.decoder import CausalLM
from usp.models.layer_kinds import FULL, SLIDING, check_window


@dataclass(frozen=True)
class MistralConfig(DecoderConfig):
    """Mistral hyper-parameters (HF ``config.json`` names)."""

    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    sliding_window: int | None = None

    family: ClassVar[str] = "mistral"
    architectures: ClassVar[tuple[str, ...]] = ("MistralForCausalLM",)
    model_type: ClassVar[str] = "mistral"
    # transformers' MistralConfig for keys a config.json leaves out
    hf_defaults: ClassVar[dict[str, Any]] = {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.sliding_window)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Every layer slides when ``sliding_window`` is set (transformers' Mistral)."""
        return (FULL if self.sliding_window is None else SLIDING,) * self.num_hidden_layers


#: the published Mistral-7B v0.3 shape (config.json of mistralai/Mistral-7B-v0.3)
PRESETS: dict[str, MistralConfig] = {
    "mistral-7b": MistralConfig(
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


class Mistral(CausalLM):
    """A Mistral causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = MistralConfig
    presets = PRESETS

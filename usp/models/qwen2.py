"""The Qwen2 / Qwen2.5 family: the stack with a bias on the q, k and v projections (none
on the output projection), as transformers' ``Qwen2Attention``.

Qwen's sliding window (:class:`QwenWindow`: ``use_sliding_window``, ``sliding_window``,
``max_window_layers``, ``layer_types``; Qwen2, Qwen2.5, Qwen3) is off in the published
checkpoints; where a config turns it on, its layers' windows are computed exactly by USP
attention, at any length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from usp.errors import ModelConfigError
from usp.models.attention import AttentionOptions
from usp.models.config import DecoderConfig
from usp.models.decoder import CausalLM
from usp.models.layer_kinds import FULL, SLIDING, check_window

#: transformers' defaults for a Qwen config.json's missing keys (Qwen2Config, Qwen3Config)
QWEN_HF_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "num_key_value_heads": 32,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}


@dataclass(frozen=True)
class QwenWindow:
    """Qwen's sliding-window settings (Qwen2, Qwen2.5, Qwen3), kept as config.json has
    them and read as transformers reads them: a window only with ``use_sliding_window``,
    on the layers ``layer_types`` marks ``sliding_attention`` (default: those from
    ``max_window_layers`` on), computed exactly. A mixin of a family's config, before
    :class:`DecoderConfig` in its bases."""

    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # DecoderConfig's checks
        check_window(self.sliding_window)
        if self.layer_types is None:
            return
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_hidden_layers or not set(types) <= {FULL, SLIDING}:
            raise ModelConfigError(
                f"layer_types must name one of {FULL!r}, {SLIDING!r} for each of the "
                f"{self.num_hidden_layers} layers, got {list(types)}"
            )

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        layers = self.num_hidden_layers
        if not self.use_sliding_window or self.sliding_window is None:
            return (FULL,) * layers
        return self.layer_types or tuple(
            SLIDING if i >= self.max_window_layers else FULL for i in range(layers)
        )

    def replace(self, **changes):
        """A changed copy; another depth without ``layer_types`` keeps the kinds of the
        layers that remain (and transformers' rule past them)."""
        layers = changes.get("num_hidden_layers", self.num_hidden_layers)
        if self.layer_types is not None and "layer_types" not in changes:
            kept = self.layer_types[:layers]
            rule = [SLIDING if i >= self.max_window_layers else FULL for i in range(layers)]
            changes["layer_types"] = kept + tuple(rule[len(kept) :])
        return super().replace(**changes)


@dataclass(frozen=True)
class Qwen2Config(QwenWindow, DecoderConfig):
    """Qwen2 / Qwen2.5 hyper-parameters (HF ``config.json`` names)."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768

    family: ClassVar[str] = "qwen2"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2ForCausalLM",)
    model_type: ClassVar[str] = "qwen2"
    hf_defaults: ClassVar[dict[str, Any]] = QWEN_HF_DEFAULTS


_QWEN25 = {"vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151643}

#: the published Qwen2.5 shapes (config.json of Qwen/Qwen2.5-7B and -72B)
PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-7b": Qwen2Config(
        **_QWEN25,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,  # not divisible by 8: the hybrid's case (u=4 or 7 x ring)
        num_key_value_heads=4,
        max_position_embeddings=131072,
        sliding_window=131072,
    ),
    "qwen2.5-72b": Qwen2Config(
        **_QWEN25,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        sliding_window=131072,
        max_window_layers=80,
    ),
}


class Qwen2(CausalLM):
    """A Qwen2 / Qwen2.5 causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Qwen2Config
    presets = PRESETS

    @staticmethod
    def attention_options(config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)  # q, k, v carry a bias; o_proj does not

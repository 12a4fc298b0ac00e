"""The Gemma 3 text family (``Gemma3ForCausalLM``; the language model of
``Gemma3ForConditionalGeneration`` checkpoints), as transformers 5 computes it: the stack
with Gemma's zero-centred RMSNorm (``1 + weight``) on every norm, four norms a layer
(each sub-block's output normed before the residual), the embedding scaled by
``sqrt(hidden_size)``, per-head q/k norms and ``query_pre_attn_scalar ** -0.5`` as the
attention scale, per-layer kinds (``layer_types``: ``sliding_attention`` over
``sliding_window`` keys, ``full_attention``; by default every 6th layer is full) with a
RoPE per kind (``rope_local_base_freq`` plain on sliding layers, ``rope_theta`` with
``rope_scaling`` on full ones), a GeGLU MLP (``gelu_pytorch_tanh``), tied embeddings by
default and ``final_logit_softcapping`` when set (the loss then materialises this rank's
logits). Refused by name: ``attn_logit_softcapping`` (USP attention has no score
soft-capping), ``use_bidirectional_attention``, another activation, a RoPE scaling on
sliding layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from usp.errors import ModelConfigError
from usp.models.attention import AttentionOptions
from usp.models.config import DecoderConfig, check_numbers
from usp.models.decoder import CausalLM
from usp.models.hf_keys import transformers_key_form
from usp.models.language_model import MultimodalText, language_model_key
from usp.models.layer_kinds import FULL, SLIDING, LayerTypes
from usp.models.mlp import MLP
from usp.models.norm import ZeroCentredRMSNorm
from usp.models.parts import Blueprint
from usp.models.rope_config import RopeSettings


@dataclass(frozen=True)
class Gemma3Config(MultimodalText, LayerTypes, DecoderConfig):
    """Gemma 3 text hyper-parameters (HF ``config.json`` names). ``rope_theta`` and
    ``rope_scaling`` are the full-attention layers' RoPE, ``rope_local_base_freq`` the
    sliding layers' theta. ``layer_types=None``: transformers' default pattern."""

    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131_072
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    rope_local_base_freq: float = 10_000.0
    final_logit_softcapping: float | None = None
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | list[int] | None = 2

    family: ClassVar[str] = "gemma3"
    architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",
                                                 "Gemma3ForConditionalGeneration")  # fmt: skip
    model_type: ClassVar[str] = "gemma3_text"
    multimodal_type: ClassVar[str] = "gemma3"
    text_defaults: ClassVar[dict[str, Any]] = {"vocab_size": 262_208, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8}  # fmt: skip
    hf_defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 131_072, "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 2, "tie_word_embeddings": True}  # fmt: skip
    hf_fixed: ClassVar[dict[str, Any]] = {"hidden_activation": "gelu_pytorch_tanh",
        "attention_dropout": 0.0, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False}  # fmt: skip
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias",)
    #: transformers' Gemma3TextConfig: every 6th layer full unless ``layer_types`` says
    pattern_key: ClassVar[str] = "sliding_window_pattern"
    default_pattern: ClassVar[int] = 6

    @classmethod
    def pattern_layer_types(cls, layers: int, pattern: int) -> tuple[str, ...]:
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_numbers(self, ("query_pre_attn_scalar", "rope_local_base_freq"), positive=True)
        cap = self.final_logit_softcapping
        if cap is not None and (not isinstance(cap, (int, float)) or not cap > 0):
            raise ModelConfigError(f"final_logit_softcapping must be null or > 0, got {cap!r}")

    def layer_rope(self, index: int) -> RopeSettings:
        """Plain RoPE of ``rope_local_base_freq`` on sliding layers."""
        if self.layer_types[index] == SLIDING:
            return RopeSettings(self.attention_head_dim, self.rope_local_base_freq)
        return super().layer_rope(index)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        """A text or multimodal config.json; RoPE in either form: 4.x ``rope_theta`` /
        ``rope_local_base_freq`` / ``rope_scaling``, 5.x ``rope_parameters`` per kind."""
        if not cls.accepts(config):
            return super().from_hf_dict(config, source=source)  # its error
        config = cls.text_dict(config, source)
        if config.get("use_bidirectional_attention") is None:
            config.pop("use_bidirectional_attention", None)
        params = config.pop("rope_parameters", None)
        if params is not None:
            if not isinstance(params, dict) or not set(params) <= {SLIDING, FULL}:
                raise ModelConfigError(
                    f"{source}: Gemma 3's rope_parameters must be one table per layer type "
                    f"({SLIDING}, {FULL}), got {params!r}"
                )
            full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
            if "rope_theta" in full:
                config["rope_theta"] = full.pop("rope_theta")
            if full.get("rope_type", "default") != "default":
                config["rope_scaling"] = full
            if "rope_theta" in local:
                config["rope_local_base_freq"] = local.pop("rope_theta")
            if local.get("rope_type", "default") != "default" or set(local) - {"rope_type"}:
                raise ModelConfigError(
                    f"{source}: a RoPE scaling on sliding_attention layers ({local}) is not "
                    "supported; usp computes plain RoPE there (rope_local_base_freq)"
                )
        config.setdefault("rope_theta", cls.rope_theta)  # transformers' global default
        return super().from_hf_dict(config, source=source)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A ``Gemma3ForCausalLM`` config.json (text only), RoPE per layer type in the
        installed transformers' form."""
        out = super().to_hf_dict(dtype=dtype)
        for key in ("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq"):
            out.pop(key, None)
        form = transformers_key_form(self.model_type)
        if form is not None and form.rope_parameters:
            full = {"rope_type": "default", **(self.rope_scaling or {})}
            out["rope_parameters"] = {
                FULL: {**full, "rope_theta": self.rope_theta},
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
            }
        else:
            scaling = dict(self.rope_scaling) if self.rope_scaling else None
            out.update(rope_theta=self.rope_theta, rope_scaling=scaling,
                       rope_local_base_freq=self.rope_local_base_freq)  # fmt: skip
        return out


def _shape(hidden, inter, layers, heads, kv, head_dim, scalar, window, context, vocab, factor):
    """A published text shape (config.json of google/gemma-3-*-pt)."""
    scaling = None if factor is None else {"rope_type": "linear", "factor": factor}
    return Gemma3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        query_pre_attn_scalar=scalar, sliding_window=window, max_position_embeddings=context,
        rope_scaling=scaling,
    )  # fmt: skip


# byte vocabulary; 3 layers (sliding, sliding, full: the pattern of 2 at this depth),
# window 16, a linear RoPE scaling on the full layer, head_dim 32 != hidden / heads
_TINY = Gemma3Config(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
    sliding_window=16, layer_types=(SLIDING, SLIDING, FULL),
    rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=65536,
)  # fmt: skip
#: the published Gemma 3 text shapes and a tiny one for tests and demos
PRESETS: dict[str, Gemma3Config] = {
    "gemma-3-1b": _shape(1152, 6912, 26, 4, 1, 256, 256, 512, 32_768, 262_144, None),
    "gemma-3-4b": _shape(2560, 10240, 34, 8, 4, 256, 256, 1024, 131_072, 262_208, 8.0),
    "gemma-3-12b": _shape(3840, 15360, 48, 16, 8, 256, 256, 1024, 131_072, 262_208, 8.0),
    "gemma-3-27b": _shape(5376, 21504, 62, 32, 16, 128, 168, 1024, 131_072, 262_208, 8.0),
    "gemma3-tiny": _TINY,
}

#: a multimodal checkpoint's vision tower and projector (not read)
_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


class Gemma3(CausalLM):
    """A Gemma 3 text causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Gemma3Config
    presets = PRESETS
    blueprint = Blueprint(norm=ZeroCentredRMSNorm, sandwich_norms=True, scaled_embedding=True)

    @staticmethod
    def attention_options(config: Gemma3Config) -> AttentionOptions:
        bias, scale = config.attention_bias, float(config.query_pre_attn_scalar) ** -0.5
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, softmax_scale=scale)

    @staticmethod
    def make_mlp(config: Gemma3Config, index: int) -> MLP:
        return MLP(config, activation="gelu_pytorch_tanh")  # GeGLU

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        """A multimodal checkpoint's language model as the text model's names."""
        return language_model_key(key, _VISION)

"""The Qwen3.5 text family (``Qwen3_5ForCausalLM``; the language model of
``Qwen3_5ForConditionalGeneration`` checkpoints), as transformers 5 computes it: the stack
with Qwen3-Next's zero-centred RMSNorm (``1 + weight``) on every norm, a SwiGLU MLP and
per-layer token mixers (``layer_types``; by default every ``full_attention_interval``-th
layer, 4, is full): Gated DeltaNet (``linear_attention``: :mod:`usp.models.gated_deltanet`,
transformers' parameters under its names, exact under Ulysses x ring) or gated full
attention (``q_proj`` gives each head's query and an output gate, per-head q/k norms,
RoPE on the first ``partial_rotary_factor * head_dim`` dims, the output times
``sigmoid(gate)``).

RoPE: transformers computes Qwen3.5's text positions as an interleaved multimodal RoPE
(``mrope_section``) whose three position axes are equal for text: the plain RoPE of the
rotary dims, which usp computes (the keys are written back). A multimodal checkpoint's
language model is read from ``model.language_model.*`` or ``language_model.model.*``;
its vision tower (``model.visual.*``) and multi-token-prediction head (``mtp.*``) are not
read nor exported (the export is a text-only ``Qwen3_5ForCausalLM``). Refused by name:
another activation, a RoPE scaling, ``attention_dropout``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from usp.errors import ModelConfigError
from usp.models.attention import AttentionOptions
from usp.models.config import DecoderConfig, check_integers
from usp.models.decoder import CausalLM
from usp.models.hf_keys import transformers_key_form
from usp.models.language_model import MultimodalText, language_model_key
from usp.models.layer_kinds import FULL, LINEAR, LayerTypes
from usp.models.norm import ZeroCentredRMSNorm
from usp.models.parts import Blueprint
from usp.models.rope_config import RopeSettings

#: the multimodal RoPE keys of rope_parameters: kept for the export, equal to the plain
#: RoPE on text positions
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
#: the GDN sizes a config.json names
GDN_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
              "linear_num_key_heads", "linear_num_value_heads")  # fmt: skip
#: transformers' Qwen3_5TextConfig defaults (5.24) for keys a config.json leaves out
QWEN3_5_HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "tie_word_embeddings": False,
    **dict(zip(GDN_FIELDS, (4, 128, 128, 16, 32))),
}  # fmt: skip
#: ... and for the keys every config.json must give elsewhere
TEXT_DEFAULTS: dict[str, Any] = {"vocab_size": 248320, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16}  # fmt: skip


@dataclass(frozen=True)
class Qwen3_5Config(MultimodalText, LayerTypes, DecoderConfig):
    """Qwen3.5 text hyper-parameters (HF ``config.json`` names). ``partial_rotary_factor``:
    the share of each full-attention head's dims RoPE rotates."""

    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mrope: dict[str, Any] | None = None  # mrope_section / mrope_interleaved, written back

    family: ClassVar[str] = "qwen3_5"
    architectures: ClassVar[tuple[str, ...]] = (
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
    )
    model_type: ClassVar[str] = "qwen3_5_text"
    multimodal_type: ClassVar[str] = "qwen3_5"
    hf_defaults: ClassVar[dict[str, Any]] = QWEN3_5_HF_DEFAULTS
    text_defaults: ClassVar[dict[str, Any]] = TEXT_DEFAULTS
    known_kinds: ClassVar[tuple[str, ...]] = (LINEAR, FULL)
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias", "layer_types", *GDN_FIELDS)

    #: transformers' Qwen3_5TextConfig: every 4th layer full unless ``layer_types`` says
    pattern_key: ClassVar[str] = "full_attention_interval"
    default_pattern: ClassVar[int] = 4

    @classmethod
    def pattern_layer_types(cls, layers: int, interval: int) -> tuple[str, ...]:
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_integers(self, dict.fromkeys(GDN_FIELDS, 1))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError(
                f"linear_num_value_heads({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads({self.linear_num_key_heads})"
            )
        factor = self.partial_rotary_factor
        if (not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1
                or self.rotary_dim < 2 or self.rotary_dim % 2):  # fmt: skip
            raise ModelConfigError(
                f"partial_rotary_factor({factor!r}) x head_dim({self.attention_head_dim}) must "
                "give an even number of rotary dims >= 2 (0 < factor <= 1)"
            )
        if self.rope_scaling is not None:
            raise ModelConfigError(
                f"a RoPE scaling ({self.rope_scaling}) is not supported for {self.family}: "
                "usp computes its plain (partial) RoPE; remove rope_scaling"
            )
        if self.mrope is not None:
            object.__setattr__(self, "mrope", dict(self.mrope))

    @property
    def rotary_dim(self) -> int:
        """The dims of a full-attention head that RoPE rotates (transformers' int())."""
        return int(self.attention_head_dim * self.partial_rotary_factor)

    def layer_rope(self, index: int) -> RopeSettings:
        return RopeSettings(self.rotary_dim, self.rope_theta)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        """A text config.json, or a multimodal one (its ``text_config``). RoPE in either
        form (``rope_parameters`` or ``rope_theta`` + ``rope_scaling``),
        ``partial_rotary_factor`` in it or at the top level."""
        if not cls.accepts(config):
            return super().from_hf_dict(config, source=source)  # its error
        config = cls.text_dict(config, source)
        rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        rope = dict(config.get(rope_key) or {})
        factor = rope.pop("partial_rotary_factor", config.pop("partial_rotary_factor", 0.25))
        mrope = {k: rope.pop(k) for k in MROPE_KEYS if k in rope}
        if rope_key in config:
            config[rope_key] = rope or None
        config["mrope"] = mrope or None
        read = super().from_hf_dict(config, source=source)  # (its RoPE reader refuses a factor)
        try:
            return read.replace(partial_rotary_factor=factor)
        except ModelConfigError as err:
            raise ModelConfigError(f"{source}: {err}") from None

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A text-only ``...ForCausalLM`` config.json in the installed transformers' form."""
        out = super().to_hf_dict(dtype=dtype)
        out.pop("mrope", None)
        rope = {"partial_rotary_factor": self.partial_rotary_factor, **(self.mrope or {})}
        form = transformers_key_form(self.model_type)
        if form is not None and form.rope_parameters:
            out.pop("partial_rotary_factor", None)
            out["rope_parameters"] = {**out.get("rope_parameters", {}), **rope}
        else:
            out.update(rope)
        return out


_TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_hidden_layers=4, layer_types=(LINEAR, LINEAR, FULL, LINEAR),
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, max_position_embeddings=65536)  # fmt: skip
#: shapes of transformers' own Qwen3.5 configs and a tiny one for tests and demos
PRESETS: dict[str, Qwen3_5Config] = {
    # transformers 5.24's Qwen3_5TextConfig defaults, which its docstring calls
    # "Qwen3.5-9B style" (not checked against the hub's config.json: offline here); the
    # model cards' 262,144-token context
    "qwen3.5-9b": Qwen3_5Config(
        **{**TEXT_DEFAULTS, **QWEN3_5_HF_DEFAULTS, "max_position_embeddings": 262_144}
    ),
    # byte vocabulary; 4 layers (linear, linear, full, linear), 2 key / 4 value GDN heads,
    # head_dim 16 with a quarter rotated, untied
    "qwen3.5-tiny": Qwen3_5Config(**_TINY, intermediate_size=128),
}

#: a multimodal checkpoint's vision tower and the multi-token-prediction head (not read)
_NOT_READ = re.compile(r"^(mtp\.|(model\.)?visual\.)")


class Qwen3_5(CausalLM):
    """A Qwen3.5 text causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Qwen3_5Config
    presets = PRESETS
    blueprint = Blueprint(norm=ZeroCentredRMSNorm)

    @staticmethod
    def attention_options(config: Qwen3_5Config) -> AttentionOptions:
        bias = bool(config.attention_bias)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, output_gate=True)

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        """A multimodal checkpoint's language model as the text model's names."""
        return language_model_key(key, _NOT_READ)

"""The Gemma 3 text family (``Gemma3ForCausalLM``; the language model of
``Gemma3ForConditionalGeneration`` checkpoints), as transformers 5 computes it:

* per-layer attention types (``layer_types``: ``sliding_attention`` with
  ``sliding_window``, ``full_attention``; by default every 6th layer is full), each
  sliding layer's window computed exactly by USP attention across Ulysses x ring;
* a RoPE per layer type: ``rope_local_base_freq`` on sliding layers (plain RoPE),
  ``rope_theta`` with ``rope_scaling`` on full layers;
* Gemma's RMSNorm (``x / rms(x) * (1 + weight)``, multiplied in float32 before the cast
  back; weights start at 0): on q and k per head, and four per layer (input,
  post-attention, pre-feedforward, post-feedforward: each sub-block's output is normed
  before it joins the residual);
* the embedding scaled by ``sqrt(hidden_size)`` rounded to the model's dtype, its
  ``pad_token_id`` row without gradient from the input side (``padding_idx``);
  ``query_pre_attn_scalar ** -0.5`` as the attention scale; a GeGLU MLP
  (``gelu_pytorch_tanh``); tied embeddings by default;
* ``final_logit_softcapping`` (token-local: ``cap * tanh(logits / cap)``) when set; the
  loss then materialises this rank's logits (no loss chunks).

Refused by name: ``attn_logit_softcapping`` (USP attention has no score soft-capping),
``use_bidirectional_attention``, another activation, a RoPE scaling on sliding layers,
and the MLP tiling lever (it computes SwiGLU). The whole family is this file, its entry
in :data:`usp.models.family.FAMILIES` and the decoder's ``stack_class`` /
``checkpoint_key`` hooks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from usp.errors import ModelConfigError
from usp.models.config import DecoderConfig
from usp.models.decoder import (
    WINDOW_COMPILE_REFUSAL,
    Attention,
    CausalLM,
    _check_tokens,
    pad_row_embedding,
)
from usp.models.hf_keys import transformers_key_form
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import loss_dtype, sp_normalise
from usp.models.rope import apply_rope, attention_factor, inverse_frequencies, rope_cos_sin

SLIDING, FULL = "sliding_attention", "full_attention"
#: transformers' Gemma3TextConfig: every 6th layer full unless ``layer_types`` says
DEFAULT_SLIDING_PATTERN = 6
#: Gemma3TextConfig's defaults of the keys every config.json must give elsewhere (the
#: text_config of a multimodal checkpoint often leaves them out)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
}
TEXT_ARCHITECTURE, MULTIMODAL_ARCHITECTURE = "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
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
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float = 10_000.0
    final_logit_softcapping: float | None = None
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | list[int] | None = 2

    family: ClassVar[str] = "gemma3"
    architectures: ClassVar[tuple[str, ...]] = (TEXT_ARCHITECTURE, MULTIMODAL_ARCHITECTURE)
    model_type: ClassVar[str] = "gemma3_text"
    hf_defaults: ClassVar[dict[str, Any]] = {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
    }
    hf_fixed: ClassVar[dict[str, Any]] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias",)

    def __post_init__(self) -> None:
        super().__post_init__()
        types = self.layer_types
        if types is None:
            types = [
                SLIDING if (i + 1) % DEFAULT_SLIDING_PATTERN else FULL
                for i in range(self.num_hidden_layers)
            ]
        types = tuple(types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_hidden_layers or not set(types) <= {SLIDING, FULL}:
            raise ModelConfigError(
                f"layer_types must name one of {SLIDING!r}, {FULL!r} for each of the "
                f"{self.num_hidden_layers} layers, got {list(types)}"
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):  # fmt: skip
            raise ModelConfigError(f"sliding_window must be a positive integer, got {window!r}")
        if window is None and SLIDING in types:
            raise ModelConfigError(
                "sliding_window is null but layer_types has sliding_attention layers: give "
                "the window (Gemma 3: 512 or 1024)"
            )
        for name in ("query_pre_attn_scalar", "rope_local_base_freq"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ModelConfigError(f"{name} must be a number > 0, got {value!r}")
        cap = self.final_logit_softcapping
        if cap is not None and (not isinstance(cap, (int, float)) or not cap > 0):
            raise ModelConfigError(f"final_logit_softcapping must be null or > 0, got {cap!r}")

    def replace(self, **changes) -> Gemma3Config:
        """A copy with ``changes``; another depth without ``layer_types`` keeps the
        layers' kinds in order, repeating them past the last (the planner's shallower
        copies measure the model's first layers)."""
        layers = changes.get("num_hidden_layers", self.num_hidden_layers)
        if "layer_types" not in changes and layers != self.num_hidden_layers:
            types = self.layer_types
            changes["layer_types"] = tuple(types[i % len(types)] for i in range(layers))
        return super().replace(**changes)

    @property
    def attention_window(self) -> int | None:
        """None: the sliding layers' windows are computed exactly (no length limit)."""
        return None

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (None: full causal attention)."""
        return self.sliding_window if self.layer_types[index] == SLIDING else None

    def local_rope(self) -> DecoderConfig:
        """This config with the sliding layers' RoPE (what rope.py computes from)."""
        return self.replace(rope_theta=self.rope_local_base_freq, rope_scaling=None)

    def layer_variants(self) -> list[tuple[DecoderConfig, int]]:
        return [
            (self.replace(num_hidden_layers=1, layer_types=(kind,)), self.layer_types.count(kind))
            for kind in (SLIDING, FULL)
            if kind in self.layer_types
        ]

    # ------------------------------------------------------------------ HF format
    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        """A ``Gemma3ForCausalLM`` config.json, or a ``Gemma3ForConditionalGeneration``
        one (its ``text_config``: the language model; the vision tower is not read).
        RoPE in either form: 4.x ``rope_theta`` / ``rope_local_base_freq`` /
        ``rope_scaling``, 5.x ``rope_parameters`` per layer type."""
        if not cls.accepts(config):
            return super().from_hf_dict(config, source=source)  # its error
        config = _text_config(config, source)
        if config.get("use_bidirectional_attention") is None:
            config.pop("use_bidirectional_attention", None)
        if config.get("layer_types") is None:
            config.pop("layer_types", None)
            pattern = config.get("sliding_window_pattern", DEFAULT_SLIDING_PATTERN)
            layers = config.get("num_hidden_layers")
            if isinstance(pattern, int) and isinstance(layers, int) and pattern >= 1:
                config["layer_types"] = [
                    SLIDING if (i + 1) % pattern else FULL for i in range(layers)
                ]
        params = config.pop("rope_parameters", None)
        if params is not None:
            if not isinstance(params, dict) or not set(params) <= {SLIDING, FULL}:
                raise ModelConfigError(
                    f"{source}: Gemma 3's rope_parameters must be one table per layer type "
                    f"({SLIDING}, {FULL}), got {params!r}"
                )
            full = dict(params.get(FULL) or {})
            local = dict(params.get(SLIDING) or {})
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

    @classmethod
    def hf_read_only(cls) -> tuple[str, ...]:
        return ("sliding_window_pattern", "text_config", "vision_config")

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A ``Gemma3ForCausalLM`` config.json (text only), RoPE per layer type in the
        installed transformers' form."""
        out = super().to_hf_dict(dtype=dtype)
        for key in ("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq"):
            out.pop(key, None)
        out["architectures"] = [TEXT_ARCHITECTURE]
        out["layer_types"] = list(self.layer_types)
        form = transformers_key_form(self.model_type)
        if form is not None and form.rope_parameters:
            full = {"rope_type": "default", **(self.rope_scaling or {})}
            out["rope_parameters"] = {
                FULL: {**full, "rope_theta": self.rope_theta},
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
            }
        else:
            out.update(
                rope_theta=self.rope_theta,
                rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
                rope_local_base_freq=self.rope_local_base_freq,
            )
        return out


def _text_config(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's config dict (a multimodal config's ``text_config`` with
    transformers' defaults for what it leaves out)."""
    archs = config.get("architectures") or []
    multimodal = MULTIMODAL_ARCHITECTURE in archs or (
        not archs and config.get("model_type") == "gemma3"
    )
    if not multimodal:
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ModelConfigError(
            f"{source}: a {MULTIMODAL_ARCHITECTURE} config.json without a text_config "
            "object: usp trains its language model and needs that config"
        )
    out = {**TEXT_DEFAULTS, **text}
    for key in ("torch_dtype", "dtype"):  # the weights' dtype is stated at the top
        if key in config:
            out.setdefault(key, config[key])
    out["architectures"] = [TEXT_ARCHITECTURE]
    out["model_type"] = "gemma3_text"
    return out


def _gemma_config(name: str) -> dict[str, Any]:
    """The published text shapes (config.json of google/gemma-3-*-pt)."""
    shapes = {
        "1b": (1152, 6912, 26, 4, 1, 256, 256, 512, 32_768, 262_144, None),
        "4b": (2560, 10240, 34, 8, 4, 256, 256, 1024, 131_072, 262_208, 8.0),
        "12b": (3840, 15360, 48, 16, 8, 256, 256, 1024, 131_072, 262_208, 8.0),
        "27b": (5376, 21504, 62, 32, 16, 128, 168, 1024, 131_072, 262_208, 8.0),
    }
    hidden, inter, layers, heads, kv, head_dim, scalar, window, context, vocab, factor = shapes[
        name
    ]
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
        sliding_window=window,
        max_position_embeddings=context,
        rope_scaling=None if factor is None else {"rope_type": "linear", "factor": factor},
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


#: the published Gemma 3 text shapes and a tiny one for tests and demos
PRESETS: dict[str, Gemma3Config] = {
    **{f"gemma-3-{n}": Gemma3Config(**_gemma_config(n)) for n in ("1b", "4b", "12b", "27b")},
    # byte vocabulary; 3 layers (sliding, sliding, full: the pattern of 2 at this depth),
    # window 16, a linear RoPE scaling on the full layer, head_dim 32 != hidden / heads
    "gemma3-tiny": Gemma3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=16,
        layer_types=(SLIDING, SLIDING, FULL),
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=65536,
    ),
}


# ---------------------------------------------------------------------- modules
class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), normalised and multiplied in float32 at least (float64
    stays float64), then cast back (Gemma's order: the product is rounded once). The
    weight starts at 0 (the identity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(wide.dtype))).to(x.dtype)

    @torch.no_grad()
    def init_weights(self, std: float, generator=None) -> None:
        self.weight.zero_()


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) (transformers' ``gelu_pytorch_tanh``). Not a
    SwiGLU: the MLP tiling lever refuses it (``act_fn`` is not SiLU)."""

    def __init__(self, config: Gemma3Config):
        super().__init__()
        dim, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Gemma3Attention(Attention):
    """Gemma's per-head q/k norms, ``query_pre_attn_scalar`` scale and this layer's
    window (None on full layers)."""

    def __init__(self, config: Gemma3Config, plan, index: int):
        super().__init__(config, plan)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.window = config.layer_window(index)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed=None):
        batch, tokens, _ = x.shape  # [B, S/P, dim]
        q, k, v = self.project(x)  # [B, S/P, H or Hkv, D]
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        out = self.plan.attention(
            q,
            k,
            v,
            causal=True,
            softmax_scale=self.scale,
            packed=packed,
            head_chunks=self.head_chunks,
            window=self.window,
        )  # fmt: skip  (out [B, S/P, H, D])
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))


class Gemma3DecoderLayer(nn.Module):
    """Each sub-block's output normed before it joins the residual (four norms)."""

    def __init__(self, config: Gemma3Config, plan, index: int, mlp: nn.Module):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Gemma3Attention(config, plan, index)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x, cos, sin, packed=None):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, packed)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Stack(nn.Module):
    """The scaled embedding, the layers (each with its type's RoPE) and the final norm
    (HF's ``model.`` prefix)."""

    def __init__(self, config: Gemma3Config, plan, attention_class=None, make_mlp=None):
        super().__init__()
        self.config = config
        self.plan = plan
        self.embed_tokens = pad_row_embedding(config)
        make_mlp = make_mlp or (lambda config, index: GeGLU(config))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, plan, index, make_mlp(config, index))
            for index in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed=None):
        """input_ids [B, S/P], position_ids [S/P] or [B, S/P] -> hidden [B, S/P, dim]."""
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype, as transformers' buffer holds it
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype, device=x.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]  # [1, S/P]
        rope = {}
        for kind, config in ((FULL, self.config), (SLIDING, self.config.local_rope())):
            if kind in self.config.layer_types:
                inv_freq = inverse_frequencies(config, device=x.device)
                rope[kind] = rope_cos_sin(position_ids, inv_freq, x.dtype, attention_factor(config))
        for layer, kind in zip(self.layers, self.config.layer_types):
            x = layer(x, *rope[kind], packed)
        return self.norm(x)


class Gemma3(CausalLM):
    """A Gemma 3 text causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Gemma3Config
    presets = PRESETS
    attention_class = Gemma3Attention
    stack_class = Gemma3Stack
    allgather_compile_refusal = WINDOW_COMPILE_REFUSAL

    @staticmethod
    def make_mlp(config: Gemma3Config, index: int) -> nn.Module:
        return GeGLU(config)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """:meth:`CausalLM.init_weights`, the pad token's embedding row 0 (as
        transformers); Gemma's norm weights 0 (the identity)."""
        super().init_weights(generator)
        pad = self.model.embed_tokens.padding_idx
        if pad is not None:
            self.model.embed_tokens.weight[pad].zero_()

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        """Gemma3ForConditionalGeneration's language model as the text model's names
        (``language_model.model.*`` as published, ``model.language_model.*`` as
        transformers 5 writes); its vision tower and projector are not read."""
        for prefix, replacement in _MULTIMODAL_KEYS:
            if key.startswith(prefix):
                return replacement + key[len(prefix) :]
        if _VISION_KEY.match(key):
            return None
        return key

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection, then ``cap * tanh(logits / cap)`` when
        ``final_logit_softcapping`` is set (token-local, as transformers)."""
        logits = F.linear(hidden, self.output_weight)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens=None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        if cap is None:
            return super().forward(
                input_ids, labels=labels, position_ids=position_ids, cu_seqlens=cu_seqlens,
                num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
            )  # fmt: skip
        _check_tokens(input_ids, labels, position_ids)  # before any collective
        hidden = self.hidden_states(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)
        logits = self.logits(hidden)  # [B, S/P, V], capped
        if labels is None:
            return logits
        local = F.cross_entropy(
            logits.flatten(0, 1).to(loss_dtype(logits.dtype)),
            labels.flatten(),
            ignore_index=ignore_index,
            reduction="sum",
        )
        count = int((labels != ignore_index).sum())
        return sp_normalise(local, count, self.plan.sp_group, num_items_in_batch=num_items_in_batch)


_MULTIMODAL_KEYS = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_KEY = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")

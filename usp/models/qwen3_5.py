"""The Qwen3.5 text family (``Qwen3_5ForCausalLM``; the language model of
``Qwen3_5ForConditionalGeneration`` checkpoints), as transformers 5 computes it:

* per-layer token mixers (``layer_types``: ``linear_attention`` and ``full_attention``; by
  default every ``full_attention_interval``-th layer, 4, is full):
  - Gated DeltaNet layers (``linear_attn``): :class:`usp.linear.GatedDeltaNet`, transformers'
    parameters under its names (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, ``conv1d``, ``A_log``, ``dt_bias``, the gated RMSNorm ``norm``,
    ``out_proj``), exact under Ulysses x ring (the conv tails and the recurrent state
    pass along the ring);
  - gated full attention (``self_attn``): ``q_proj`` gives each head's query and an
    output gate (``[q | gate]`` per head), per-head q/k norms, RoPE on the first
    ``partial_rotary_factor * head_dim`` dims only, USP attention, then the output times
    ``sigmoid(gate)`` before ``o_proj``;
* Qwen3-Next's zero-centred RMSNorm (``x / rms(x) * (1 + weight)``, weights start at 0) on
  the layers, q and k and the final norm; a SwiGLU MLP (the decoder's).

RoPE: transformers computes Qwen3.5's text positions as an interleaved multimodal RoPE
(``mrope_section``) whose three position axes are equal for text: that is the plain RoPE
of the rotary dims, which usp computes. Image/video positions are not (usp trains text).

Checkpoints: HF names; a multimodal checkpoint's language model is read from
``model.language_model.*`` (as published and as transformers 5 writes it) or
``language_model.model.*``. Not read, and not written back by ``save_pretrained`` (the
export is a text-only ``Qwen3_5ForCausalLM``): the vision tower (``model.visual.*``) and
the multi-token-prediction head (``mtp.*``). Refused by name: another activation, a
RoPE scaling, ``attention_dropout``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from usp.errors import ModelConfigError
from usp.linear.choice import GDN_HEADS, GdnShape, forced_kernel_refusal
from usp.linear.module import GatedDeltaNet
from usp.models.config import DecoderConfig
from usp.models.decoder import MLP, Attention, CausalLM, pad_row_embedding, with_router_stats
from usp.models.gemma3 import GemmaRMSNorm as ZeroCentredRMSNorm
from usp.models.hf_keys import transformers_key_form
from usp.models.moe import add_router_stats, split_layer_output
from usp.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from usp.process_groups.degrees import kv_replication_for

LINEAR, FULL = "linear_attention", "full_attention"
#: transformers' Qwen3_5TextConfig: every 4th layer full unless ``layer_types`` says
DEFAULT_FULL_INTERVAL = 4
#: the multimodal RoPE keys of rope_parameters: kept for the export, equal to the plain
#: RoPE on text positions
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
TEXT_ARCHITECTURE, MULTIMODAL_ARCHITECTURE = "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"

#: transformers' Qwen3_5TextConfig defaults (5.24) for keys a config.json leaves out
QWEN3_5_HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
#: ... and for the keys every config.json must give elsewhere (a multimodal checkpoint's
#: text_config may leave them out)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
}


@dataclass(frozen=True)
class Qwen3_5Config(DecoderConfig):
    """Qwen3.5 text hyper-parameters (HF ``config.json`` names). ``layer_types=None``:
    transformers' default pattern (every 4th layer full). ``partial_rotary_factor``: the
    share of each full-attention head's dims RoPE rotates."""

    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    partial_rotary_factor: float = 0.25
    layer_types: tuple[str, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mrope: dict[str, Any] | None = None  # mrope_section / mrope_interleaved, written back

    family: ClassVar[str] = "qwen3_5"
    architectures: ClassVar[tuple[str, ...]] = (TEXT_ARCHITECTURE, MULTIMODAL_ARCHITECTURE)
    model_type: ClassVar[str] = "qwen3_5_text"
    multimodal_type: ClassVar[str] = "qwen3_5"
    hf_defaults: ClassVar[dict[str, Any]] = QWEN3_5_HF_DEFAULTS
    text_defaults: ClassVar[dict[str, Any]] = TEXT_DEFAULTS
    shape_fields: ClassVar[tuple[str, ...]] = (
        "attention_bias",
        "layer_types",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        types = self.layer_types
        if types is None:
            types = default_layer_types(self.num_hidden_layers, DEFAULT_FULL_INTERVAL)
        types = tuple(types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_hidden_layers or not set(types) <= {LINEAR, FULL}:
            raise ModelConfigError(
                f"layer_types must name one of {LINEAR!r}, {FULL!r} for each of the "
                f"{self.num_hidden_layers} layers, got {list(types)}"
            )
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
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

    def is_linear(self, index: int) -> bool:
        return self.layer_types[index] == LINEAR

    @property
    def attention_layer_count(self) -> int:
        """Layers with softmax attention (what attention FLOPs are counted on)."""
        return self.layer_types.count(FULL)

    def linear_flops_per_token(self, chunk: int = 64) -> int:
        """Forward FLOPs per token of every GDN layer's chunked recurrence (chunks of
        ``chunk``, per value head): the in-chunk products ``K K^T`` and ``Q K^T``
        (``2 C dk`` each), the two triangular solves (``C (dk + dv)``), the in-chunk
        output (``2 C dv``) and the three products with the state (``2 dk dv`` each):
        ``C (5 dk + 3 dv) + 6 dk dv``. Projections count as matmuls; the conv (``2 K``
        per channel) is left out (small)."""
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        per_head = chunk * (5 * dk + 3 * dv) + 6 * dk * dv
        return self.layer_types.count(LINEAR) * self.linear_num_value_heads * per_head

    def replace(self, **changes) -> Qwen3_5Config:
        """A copy with ``changes``; another depth without ``layer_types`` keeps the
        layers' kinds in order, repeating them past the last (the planner's shallower
        copies measure the model's first layers)."""
        layers = changes.get("num_hidden_layers", self.num_hidden_layers)
        if "layer_types" not in changes and layers != self.num_hidden_layers:
            types = self.layer_types
            changes["layer_types"] = tuple(types[i % len(types)] for i in range(layers))
        return super().replace(**changes)

    def layer_variants(self) -> list[tuple[DecoderConfig, int]]:
        return [
            (self.replace(num_hidden_layers=1, layer_types=(kind,)), self.layer_types.count(kind))
            for kind in (LINEAR, FULL)
            if kind in self.layer_types
        ]

    def rope_config(self) -> DecoderConfig:
        """This config as rope.py sees it: RoPE over the rotary dims only."""
        return self.replace(head_dim=self.rotary_dim, partial_rotary_factor=1.0)

    # ------------------------------------------------------------------ HF format
    @classmethod
    def accepts(cls, config: dict[str, Any]) -> bool:
        archs = config.get("architectures") or []
        if archs:
            return bool(set(archs) & set(cls.architectures))
        return config.get("model_type") in (cls.model_type, cls.multimodal_type)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        """A text config.json, or a multimodal one (its ``text_config``: the language
        model; the vision config is not read). RoPE in either form (``rope_parameters``
        or ``rope_theta`` + ``rope_scaling``), ``partial_rotary_factor`` in it or at the
        top level."""
        if not cls.accepts(config):
            return super().from_hf_dict(config, source=source)  # its error
        config = cls._text_config(config, source)
        if config.get("layer_types") is None:
            config.pop("layer_types", None)
            interval = config.pop("full_attention_interval", DEFAULT_FULL_INTERVAL)
            layers = config.get("num_hidden_layers")
            if isinstance(interval, int) and isinstance(layers, int) and interval >= 1:
                config["layer_types"] = default_layer_types(layers, interval)
        config.pop("full_attention_interval", None)
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

    @classmethod
    def _text_config(cls, config: dict[str, Any], source: str) -> dict[str, Any]:
        """The text model's config dict (a multimodal config's ``text_config`` with
        transformers' defaults for what it leaves out)."""
        archs = config.get("architectures") or []
        multimodal = any(a.endswith("ForConditionalGeneration") for a in archs) or (
            not archs and config.get("model_type") == cls.multimodal_type
        )
        if not multimodal:
            return dict(config)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(
                f"{source}: a multimodal {cls.family} config.json without a text_config "
                "object: usp trains its language model and needs that config"
            )
        out = {**cls.text_defaults, **text}
        for key in ("torch_dtype", "dtype"):  # the weights' dtype is stated at the top
            if key in config:
                out.setdefault(key, config[key])
        if "tie_word_embeddings" in config:
            out.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
        out["architectures"] = [cls.architectures[0]]
        out["model_type"] = cls.model_type
        return out

    @classmethod
    def hf_read_only(cls) -> tuple[str, ...]:
        return ("text_config", "vision_config")

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A text-only ``...ForCausalLM`` config.json in the installed transformers' form."""
        out = super().to_hf_dict(dtype=dtype)
        out.pop("mrope", None)
        out["layer_types"] = list(self.layer_types)
        rope = {"partial_rotary_factor": self.partial_rotary_factor, **(self.mrope or {})}
        form = transformers_key_form(self.model_type)
        if form is not None and form.rope_parameters:
            out.pop("partial_rotary_factor", None)
            out["rope_parameters"] = {**out.get("rope_parameters", {}), **rope}
        else:
            out.update(rope)
        return out


def default_layer_types(layers: int, interval: int) -> list[str]:
    """transformers' pattern: layer i is full attention when (i + 1) % interval == 0."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


#: shapes of transformers' own Qwen3.5 configs and a tiny one for tests and demos
PRESETS: dict[str, Qwen3_5Config] = {
    # transformers 5.24's Qwen3_5TextConfig defaults, which its docstring calls
    # "Qwen3.5-9B style" (not checked against the hub's config.json: offline here); the
    # model cards' 262,144-token context
    "qwen3.5-9b": Qwen3_5Config(
        **TEXT_DEFAULTS,
        **{k: v for k, v in QWEN3_5_HF_DEFAULTS.items() if k != "max_position_embeddings"},
        max_position_embeddings=262_144,
    ),
    # byte vocabulary; 4 layers (linear, linear, full, linear), 2 key / 4 value GDN heads,
    # head_dim 16 with a quarter rotated, untied
    "qwen3.5-tiny": Qwen3_5Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
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


# ---------------------------------------------------------------------- modules
class GatedAttention(Attention):
    """Qwen3-Next's gated attention: [q | gate] per head from ``q_proj``, zero-centred
    q/k norms per head, partial RoPE, USP attention, output times sigmoid(gate)."""

    def __init__(self, config: Qwen3_5Config, plan):
        super().__init__(config, plan)
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed=None):
        batch, tokens, _ = x.shape  # [B, S/P, dim]
        shape = (batch, tokens, self.num_heads, self.head_dim)
        q, gate = self.q_proj(x).view(batch, tokens, self.num_heads, -1).chunk(2, dim=-1)
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        q, k = partial_rope(self.q_norm(q), cos, sin), partial_rope(self.k_norm(k), cos, sin)
        out = self.plan.attention(
            q,
            k,
            v,
            causal=True,
            softmax_scale=self.head_dim**-0.5,
            packed=packed,
            head_chunks=self.head_chunks,
            window=self.window,
            sinks=self.sinks,
        )  # fmt: skip  (out [B, S/P, H, D])
        out = out.reshape(shape) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head; the rest pass through."""
    rotary = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


def gated_deltanet(config: Qwen3_5Config, plan) -> GatedDeltaNet:
    return GatedDeltaNet(
        config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim,
        config.linear_conv_kernel_dim, config.rms_norm_eps, "silu", plan=plan,
    )  # fmt: skip


class Qwen3_5DecoderLayer(nn.Module):
    """A token mixer (``linear_attn`` or ``self_attn``, by ``layer_types``) and an MLP,
    each after a zero-centred RMSNorm, each added to the residual."""

    def __init__(self, config: Qwen3_5Config, plan, index: int, mlp: nn.Module):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(dim, eps)
        if config.is_linear(index):
            self.linear_attn = gated_deltanet(config, plan)
        else:
            self.self_attn = GatedAttention(config, plan)
        self.post_attention_layernorm = ZeroCentredRMSNorm(dim, eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, packed=None):
        h = self.input_layernorm(x)
        mixer = getattr(self, "linear_attn", None)
        h = mixer(h, packed=packed) if mixer is not None else self.self_attn(h, cos, sin, packed)
        x = x + h  # a mixture-of-experts MLP's router statistics ride along
        return with_router_stats(x, self.mlp(self.post_attention_layernorm(x)))


class Qwen3_5Stack(nn.Module):
    """Embeddings, the layers (full-attention ones with the partial RoPE) and the final
    norm (HF's ``model.`` prefix)."""

    def __init__(self, config: Qwen3_5Config, plan, attention_class=None, make_mlp=None):
        super().__init__()
        self.config = config
        self.plan = plan
        self.embed_tokens = pad_row_embedding(config)
        make_mlp = make_mlp or (lambda config, index: MLP(config))
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, plan, index, make_mlp(config, index))
            for index in range(config.num_hidden_layers)
        )
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed=None, router_stats=None
    ):
        """input_ids [B, S/P], position_ids [S/P] or [B, S/P] -> hidden [B, S/P, dim];
        ``router_stats`` as :class:`usp.models.decoder.DecoderStack`'s."""
        x = self.embed_tokens(input_ids)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]  # [1, S/P]
        cos = sin = None
        if FULL in self.config.layer_types:
            inv_freq = inverse_frequencies(self.config.rope_config(), device=x.device)
            cos, sin = rope_cos_sin(position_ids, inv_freq, x.dtype)  # [B|1, S/P, rotary]
        total = None
        for layer in self.layers:
            x, stats = split_layer_output(layer(x, cos, sin, packed))
            total = add_router_stats(total, stats)
        if router_stats is not None and total is not None:
            router_stats.append(total)
        return self.norm(x)


def check_linear_heads(plan, config: Qwen3_5Config) -> None:
    """Fail at model construction when the Ulysses degree cannot split the GDN heads
    (value heads over u; key heads repeated as KV heads are for GQA)."""
    if plan.topology.single_process or LINEAR not in config.layer_types:
        return
    values, keys = config.linear_num_value_heads, config.linear_num_key_heads
    kv_replication_for(
        values, keys, plan.ulysses_degree, plan.sp_degree,
        plan.topology.rank_map.ranks_per_node, names=GDN_HEADS,
        subject=f"this model's {values} GDN value heads / {keys} key heads cannot be split "
        f"over ulysses={plan.ulysses_degree}",
    )  # fmt: skip


class Qwen3_5(CausalLM):
    """A Qwen3.5 text causal LM (see :class:`usp.models.decoder.CausalLM`)."""

    config_class = Qwen3_5Config
    presets = PRESETS
    attention_class = GatedAttention
    stack_class = Qwen3_5Stack

    def __init__(self, config: Qwen3_5Config, /, plan=None, **attention_options):
        super().__init__(config, plan, **attention_options)
        check_linear_heads(self.plan, config)

    @classmethod
    def kernel_refusal(cls, config: Qwen3_5Config, plan, device, dtype) -> str | None:
        """A forced GDN kernel (the plan's ``linear_backend`` / ``linear_conv_backend``)
        that cannot run this config's Gated DeltaNet layers here (its limits)."""
        if LINEAR not in config.layer_types:
            return None
        shape = GdnShape(
            config.linear_num_key_heads, config.linear_num_value_heads,
            config.linear_key_head_dim, config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
        )  # fmt: skip
        return forced_kernel_refusal(
            plan.linear_backend, plan.linear_conv_backend, device, dtype, shape,
            plan.ulysses_degree,
        )  # fmt: skip

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """As transformers: linear, embedding and conv weights normal(0,
        initializer_range), the pad row 0, zero-centred norms 0, the gated norms 1,
        ``dt_bias`` 1 and ``A_log`` = log(uniform(0.01, 16))."""
        super().init_weights(generator)
        std = self.config.initializer_range
        pad = self.model.embed_tokens.padding_idx
        if pad is not None:
            self.model.embed_tokens.weight[pad].zero_()
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.conv1d.weight.normal_(0.0, std, generator=generator)
                module.dt_bias.fill_(1.0)
                module.norm.weight.fill_(1.0)
                low = torch.empty_like(module.A_log).uniform_(0.01, 16, generator=generator)
                module.A_log.copy_(low.log())

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        """A multimodal checkpoint's language model as the text model's names; its
        vision tower and the multi-token-prediction head are not read."""
        if _NOT_READ.match(key):
            return None
        for prefix, replacement in _MULTIMODAL_KEYS:
            if key.startswith(prefix):
                return replacement + key[len(prefix) :]
        return key


_MULTIMODAL_KEYS = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_NOT_READ = re.compile(r"^(mtp\.|(model\.)?visual\.)")

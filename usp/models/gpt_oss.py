"""The gpt-oss family (``GptOssForCausalLM``, transformers 5's layout).

* Attention: biases on q/k/v/o, one learned sink logit per query head (``sinks``, an
  extra softmax column that takes probability and gives no value) and per-layer kinds
  from ``layer_types``: ``sliding_attention`` layers see the ``sliding_window`` keys up to
  their own position, ``full_attention`` layers the whole causal prefix (by default they
  alternate, sliding first). Both go to USP attention (``window=``, ``sinks=``), exact
  under Ulysses x ring at any sequence length.
* RoPE: YaRN (``rope_scaling``/``rope_parameters`` as in the published config.json: factor
  32 over 4096 positions, ``truncate: false``; a config.json naming none gets that, as
  transformers' class does), computed by :mod:`usp.models.rope`.
* MLP: a mixture of experts on every layer (:class:`GptOssMoE`, HF's ``mlp``): the router
  (``mlp.router``: a linear layer with bias) takes the top-k logits and a softmax over
  those k; the experts (``mlp.experts``) carry biases and a clamped SwiGLU with gate and
  up interleaved in ``gate_up_proj``'s last dim: ``(clamp(up, -limit, limit) + 1) *
  g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``. Weights are held, loaded and
  saved in transformers' own layout (``gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias``
  [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]: the published bf16
  checkpoints' keys too). With ``output_router_logits`` the training loss adds
  ``router_aux_loss_coef`` times the load-balancing loss, exact under SP
  (:func:`usp.models.moe.sp_router_aux_loss`).

The published ``openai/gpt-oss-*`` checkpoints hold the experts MXFP4-quantized; they are
refused with what to do (dequantize once with transformers). RMSNorm: transformers keeps
gpt-oss's norm weights in float32 and multiplies before casting; usp multiplies in the
model's dtype (equal in float32/float64, within bf16 rounding in bf16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from usp.errors import ModelConfigError
from usp.models.config import DecoderConfig, merge_alias
from usp.models.decoder import WINDOW_COMPILE_REFUSAL, Attention, CausalLM
from usp.models.moe import Experts, SparseMoE, segment_sizes, stats_dtype
from usp.models.moe_op import register_experts_kind

#: transformers' gpt-oss RoPE for a config.json that names none (the published one)
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
#: transformers' GptOssConfig ``default_theta``
GPT_OSS_THETA = 150000.0
LAYER_KINDS = ("sliding_attention", "full_attention")

#: transformers' GptOssConfig defaults for keys a config.json leaves out
GPT_OSS_HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
}


def default_layer_types(layers: int) -> tuple[str, ...]:
    """transformers' rule: even layers slide, odd layers attend to everything."""
    return tuple(LAYER_KINDS[i % 2] for i in range(layers))


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """gpt-oss hyper-parameters (HF ``config.json`` names; ``num_experts`` is read as
    transformers' alias of ``num_local_experts``). ``layer_types=None``: alternating,
    sliding first. A config with more ``layer_types`` than layers keeps the first ones
    (shallower copies, e.g. the planner's)."""

    rms_norm_eps: float = 1e-5
    rope_theta: float = GPT_OSS_THETA
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(GPT_OSS_ROPE))
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    family: ClassVar[str] = "gpt_oss"
    architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    model_type: ClassVar[str] = "gpt_oss"
    hf_defaults: ClassVar[dict[str, Any]] = GPT_OSS_HF_DEFAULTS
    shape_fields: ClassVar[tuple[str, ...]] = ("attention_bias", "num_local_experts")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, minimum in (("num_local_experts", 1), ("num_experts_per_tok", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ModelConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ModelConfigError(
                f"num_experts_per_tok({self.num_experts_per_tok}) must be at most "
                f"num_local_experts({self.num_local_experts})"
            )
        for name in ("swiglu_alpha", "swiglu_limit", "router_aux_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ModelConfigError(f"{name} must be a number >= 0, got {value!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):  # fmt: skip
            raise ModelConfigError(
                f"sliding_window must be an integer >= 1 or null, got {window!r}"
            )
        types = self.layer_types
        if types is None:
            types = default_layer_types(self.num_hidden_layers)
        types = tuple(types)
        unknown = sorted({t for t in types if t not in LAYER_KINDS}, key=str)
        if unknown:
            raise ModelConfigError(
                f"layer_types {unknown} are not gpt-oss layer kinds; usp computes "
                f"{', '.join(LAYER_KINDS)}"
            )
        if len(types) < self.num_hidden_layers:
            raise ModelConfigError(
                f"layer_types names {len(types)} layers, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if window is None and "sliding_attention" in types:
            raise ModelConfigError(
                "layer_types has sliding_attention layers but sliding_window is null: give "
                "the window (gpt-oss: 128)"
            )
        object.__setattr__(self, "layer_types", types)

    @property
    def num_experts(self) -> int:
        """transformers' alias of ``num_local_experts`` (what the aux loss divides by)."""
        return self.num_local_experts

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    @property
    def attention_window(self) -> int | None:
        """The window of the sliding layers (None if no layer slides). Computed by USP
        attention, so documents of any length are exact (:meth:`check_window` passes)."""
        sliding = "sliding_attention" in self.layer_types[: self.num_hidden_layers]
        return self.sliding_window if sliding else None

    def check_window(self, longest_document: int, *, what: str = "a document") -> None:
        """Nothing to refuse: the windows are computed, not approximated by full causal
        attention."""

    def replace(self, **changes) -> DecoderConfig:
        """A changed copy; a new ``num_hidden_layers`` without ``layer_types`` keeps the
        kinds of the layers that remain (and the default rule for added ones)."""
        layers = changes.get("num_hidden_layers", self.num_hidden_layers)
        if "layer_types" not in changes and layers != len(self.layer_types):
            kept = self.layer_types[:layers]
            changes["layer_types"] = kept + default_layer_types(layers)[len(kept) :]
        return super().replace(**changes)

    @classmethod
    def check_hf(cls, config: dict[str, Any], source: str) -> None:
        quant = config.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ModelConfigError(
                f"{source}: the weights are quantized (quantization_config quant_method "
                f"{method!r}: the published openai/gpt-oss checkpoints hold their experts in "
                "MXFP4); usp trains unquantized weights. Dequantize once with transformers: "
                "GptOssForCausalLM.from_pretrained(path, quantization_config="
                "Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(out) "
                "(or use a bf16 copy of the checkpoint); `usp plan` can take the preset "
                "gpt-oss-20b / gpt-oss-120b"
            )

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        config = dict(config)
        # transformers' attribute_map alias
        merge_alias(config, "num_local_experts", "num_experts", source=source)
        if config.get("layer_types") is None:
            config.pop("layer_types", None)
        # as transformers' class: no RoPE given is the published YaRN with theta 150000
        if not config.get("rope_parameters") and not config.get("rope_scaling"):
            config.pop("rope_parameters", None)
            config["rope_scaling"] = dict(GPT_OSS_ROPE)
        params = config.get("rope_parameters") or {}
        if "rope_theta" not in params:
            config.setdefault("rope_theta", GPT_OSS_THETA)
        return super().from_hf_dict(config, source=source)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        out = super().to_hf_dict(dtype=dtype)
        out["layer_types"] = list(self.layer_types[: self.num_hidden_layers])
        if self.rope_scaling is None:  # plain RoPE, explicitly (no key means YaRN here)
            if "rope_parameters" in out:
                out["rope_parameters"] = {**out["rope_parameters"], "rope_type": "default"}
            else:
                out["rope_scaling"] = {"rope_type": "default"}
        return out


# ---------------------------------------------------------------------- attention
class GptOssAttention(Attention):
    """Attention with per-head sinks and this layer's window (set by :class:`GptOss` from
    ``layer_types``); biases on all four projections (``attention_bias``)."""

    def __init__(self, config: GptOssConfig, plan):
        super().__init__(config, plan)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))  # [H] logits

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.sinks.normal_(0.0, std, generator=generator)

    def extra_repr(self) -> str:
        return f"window={self.window}"


# ---------------------------------------------------------------------- the experts
class GptOssRouter(nn.Module):
    """``x`` [N, H] -> (softmax over all logits [N, E] in :func:`stats_dtype`, for the
    load-balancing statistics; the softmax of the top-k logits [N, k] in ``x``'s dtype;
    the top-k experts [N, k]). Logits ``x W^T + b``; the k-way softmax runs in float32 at
    least (transformers: in the logits' dtype; equal in float32/float64)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight, self.bias).to(stats_dtype(x.dtype))  # [N, E]
        top, experts = torch.topk(logits, self.top_k, dim=-1)  # [N, k]
        weights = torch.softmax(top, dim=-1)
        return torch.softmax(logits, dim=-1), weights.to(x.dtype), experts

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.weight.normal_(0.0, std, generator=generator)
        self.bias.normal_(0.0, std, generator=generator)

    def matmul_parameters(self) -> int:
        return self.weight.numel()


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: [..., 2I] (gate, up interleaved) -> [..., I]."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(Experts):
    """``E`` experts with biases and :func:`clamped_swiglu`, in transformers' layout
    (weights [E, in, out], checkpoints hold the grouped tensors); run sorted by expert
    as :class:`usp.models.moe.Experts` (a grouped GEMM where torch has one)."""

    per_expert_checkpoint = False

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        alpha: float,
        limit: float,
    ):
        nn.Module.__init__(self)
        self.num_experts, self.top_k, self.alpha, self.limit = num_experts, top_k, alpha, limit
        inner = 2 * intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, inner))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.grouped_gemm: bool | None = None

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.gate_up_proj.normal_(0.0, std, generator=generator)
        self.down_proj.normal_(0.0, std, generator=generator)
        self.gate_up_proj_bias.zero_()
        self.down_proj_bias.zero_()

    def routed_parameters(self) -> int:
        """Parameters of the ``top_k`` experts one token uses (biases included)."""
        return sum(p[0].numel() for p in self.parameters()) * self.top_k

    kind = "gpt_oss"

    def op_params(self) -> list[torch.Tensor]:
        return [self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias]

    def op_options(self) -> list[float]:
        return [float(self.alpha), float(self.limit)]


def _run_gpt_oss(rows, counts, row_experts, params, options, grouped) -> torch.Tensor:
    """rows [M, H] sorted by expert, counts [E], row_experts [M] -> [M, H]: gpt-oss's
    experts (``params`` as :meth:`GptOssExperts.op_params`, ``options`` alpha and limit)
    on their segments."""
    gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias = params
    alpha, limit = options
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # [E] segment ends (no host sync)
        gate_up = torch._grouped_mm(rows, gate_up_proj, offs=offsets)  # [M, 2I]
        gate_up = gate_up + gate_up_proj_bias.index_select(0, row_experts)
        hidden = clamped_swiglu(gate_up, alpha, limit)  # [M, I]
        out = torch._grouped_mm(hidden, down_proj, offs=offsets)  # [M, H]
        return out + down_proj_bias.index_select(0, row_experts)
    # unbind once (as usp.models.moe's segments do): one backward writes every expert's
    # gradient into one [E, ...] tensor, where indexing per expert would give each
    # expert a full-size zero gradient
    gate_ups, gate_up_biases, downs, down_biases = (p.unbind(0) for p in params)
    outputs = []
    for expert, segment in enumerate(rows.split(segment_sizes(rows, counts))):
        if segment.shape[0]:
            gate_up = torch.addmm(gate_up_biases[expert], segment, gate_ups[expert])  # [n, 2I]
            hidden = clamped_swiglu(gate_up, alpha, limit)  # [n, I]
            outputs.append(torch.addmm(down_biases[expert], hidden, downs[expert]))  # [n, H]
    return torch.cat(outputs) if outputs else rows.new_zeros(rows.shape)


register_experts_kind("gpt_oss", _run_gpt_oss)


class GptOssMoE(SparseMoE):
    """gpt-oss's ``mlp``: ``router`` + ``experts`` (x [B, S/P, H] -> [B, S/P, H], token by
    token; router statistics collected as :class:`usp.models.moe.SparseMoE` does)."""

    def __init__(self, config: GptOssConfig):
        nn.Module.__init__(self)
        self.router = GptOssRouter(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok
        )
        self.experts = GptOssExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            config.num_experts_per_tok,
            config.swiglu_alpha,
            config.swiglu_limit,
        )
        self.shared_expert = self.shared_expert_gate = None  # gpt-oss has none

    def route(self, flat: torch.Tensor):
        return self.router(flat)


# ---------------------------------------------------------------------- presets
#: published shapes (config.json of openai/gpt-oss-20b and openai/gpt-oss-120b) and a
#: tiny one for tests and demos
_PUBLISHED = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_experts_per_tok=4,
    sliding_window=128,
    router_aux_loss_coef=0.9,
    eos_token_id=200002,
    pad_token_id=199999,
)
PRESETS: dict[str, GptOssConfig] = {
    "gpt-oss-20b": GptOssConfig(**_PUBLISHED, num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": GptOssConfig(**_PUBLISHED, num_hidden_layers=36, num_local_experts=128),
    # byte vocabulary; 8 experts, top-2, window 16, the load-balancing loss on
    "gpt-oss-tiny": GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
}


class GptOss(CausalLM):
    """A gpt-oss causal LM (see :class:`usp.models.decoder.CausalLM`); layer ``i``'s
    attention slides over ``sliding_window`` keys when ``layer_types[i]`` says so."""

    config_class = GptOssConfig
    presets = PRESETS
    #: its experts compile (usp.models.moe_op), its windows over packed documents only
    #: on the p2p ring
    allgather_compile_refusal = WINDOW_COMPILE_REFUSAL
    attention_class = GptOssAttention

    def __init__(self, config: GptOssConfig, /, plan=None, **attention_options):
        super().__init__(config, plan, **attention_options)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn.window = config.layer_window(index)

    @staticmethod
    def make_mlp(config: GptOssConfig, index: int):
        return GptOssMoE(config)

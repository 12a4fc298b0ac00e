"""The Qwen3-MoE family (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k norms)
with a mixture-of-experts MLP (:class:`usp.models.moe.SparseMoE`: softmax router, top-k,
``norm_topk_prob``) on the layers transformers makes sparse -- layer ``i`` unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (those keep a dense SwiGLU
MLP of ``intermediate_size``). With ``output_router_logits`` the training loss adds
``router_aux_loss_coef`` times the load-balancing loss, exact under SP
(:func:`usp.models.moe.sp_router_aux_loss`).

Checkpoints hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, as published
and as transformers 5 writes them); the model holds them grouped, under transformers 5's
in-memory names (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
[E, H, I]); :mod:`usp.models.checkpoint` converts both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from usp.errors import ModelConfigError
from usp.models.config import DecoderConfig, check_integers, check_routing, merge_alias
from usp.models.decoder import CausalLM
from usp.models.layer_kinds import FULL, SLIDING, check_window
from usp.models.mlp import MLP
from usp.models.moe import SparseMoE
from usp.models.qwen2 import QWEN_HF_DEFAULTS
from usp.models.qwen3 import Qwen3

#: transformers' Qwen3MoeConfig defaults for keys a config.json leaves out
QWEN3_MOE_HF_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in QWEN_HF_DEFAULTS.items() if k != "max_window_layers"},
    "num_key_value_heads": 4,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}


@dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """Qwen3-MoE hyper-parameters (HF ``config.json`` names; ``num_experts`` is also read
    as transformers 5 writes it, ``num_local_experts``)."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    family: ClassVar[str] = "qwen3_moe"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    model_type: ClassVar[str] = "qwen3_moe"
    hf_defaults: ClassVar[dict[str, Any]] = QWEN3_MOE_HF_DEFAULTS
    shape_fields: ClassVar[tuple[str, ...]] = (
        "attention_bias",
        "moe_intermediate_size",
        "num_experts",
        "decoder_sparse_step",
        "mlp_only_layers",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        check_integers(self, {"moe_intermediate_size": 1, "num_experts": 0,
                              "num_experts_per_tok": 1, "decoder_sparse_step": 1})  # fmt: skip
        check_routing(self)
        # (indices past the last layer are allowed, as transformers allows them: a
        # shallower copy of a config, e.g. the planner's, keeps its list)
        bad = [
            i
            for i in self.mlp_only_layers
            if not isinstance(i, int) or isinstance(i, bool) or i < 0
        ]
        if bad:
            raise ModelConfigError(
                f"mlp_only_layers must hold layer indices (integers >= 0), got "
                f"{list(self.mlp_only_layers)}"
            )
        check_window(self.sliding_window)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """transformers' Qwen3-MoE applies ``sliding_window`` to every layer when
        ``use_sliding_window`` is set."""
        sliding = self.use_sliding_window and self.sliding_window is not None
        return (SLIDING if sliding else FULL,) * self.num_hidden_layers

    def is_sparse(self, index: int) -> bool:
        """Whether layer ``index`` has experts (transformers' rule)."""
        return (
            index not in self.mlp_only_layers
            and self.num_experts > 0
            and (index + 1) % self.decoder_sparse_step == 0
        )

    def layer_variants(self) -> list[tuple[DecoderConfig, int]]:
        sparse = sum(self.is_sparse(i) for i in range(self.num_hidden_layers))
        one = dict(num_hidden_layers=1, decoder_sparse_step=1)
        variants = [(self.replace(**one, mlp_only_layers=()), sparse)]
        if sparse < self.num_hidden_layers:
            variants.append(
                (self.replace(**one, mlp_only_layers=(0,)), self.num_hidden_layers - sparse)
            )
        return [(c, n) for c, n in variants if n]

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
        config = dict(config)
        # transformers 5 writes num_experts under this name
        merge_alias(config, "num_experts", "num_local_experts", source=source)
        if config.get("mlp_only_layers") is None:
            config.pop("mlp_only_layers", None)
        return super().from_hf_dict(config, source=source)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        out = super().to_hf_dict(dtype=dtype)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        return out


#: published shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B) and a
#: tiny one for tests and demos
_PUBLISHED = dict(
    vocab_size=151936,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)
PRESETS: dict[str, Qwen3MoeConfig] = {
    "qwen3-30b-a3b": Qwen3MoeConfig(
        **_PUBLISHED,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
    ),
    "qwen3-235b-a22b": Qwen3MoeConfig(
        **_PUBLISHED,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
    ),
    # byte vocabulary; 8 experts, top-2, the load-balancing loss on; layer 0 dense
    "qwen3-moe-tiny": Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=True,
        max_position_embeddings=65536,
    ),
}


class Qwen3Moe(CausalLM):
    """A Qwen3-MoE causal LM: Qwen3's attention, experts on the sparse layers (see
    :class:`usp.models.decoder.CausalLM`)."""

    config_class = Qwen3MoeConfig
    presets = PRESETS
    attention_options = staticmethod(Qwen3.attention_options)

    @staticmethod
    def make_mlp(config: Qwen3MoeConfig, index: int):
        if not config.is_sparse(index):
            return MLP(config)
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )

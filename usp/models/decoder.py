"""The decoder-only causal LM every family here is (:class:`CausalLM`), sequence-parallel
through a :class:`usp.Plan`: its construction from a family's choices, checkpoints,
and the forward with its SP-exact loss.

A family (``usp/models/<family>.py``) is a config class (its HF ``config.json``: names,
defaults, each layer's kind, window and RoPE) and a subclass of :class:`CausalLM` that
names its parts: the :class:`usp.models.parts.Blueprint` (norms, their placement, the
embedding), its attention's :class:`usp.models.attention.AttentionOptions` and each
layer's MLP. The stack they build is :mod:`usp.models.stack`; the token mixers
:mod:`usp.models.mixers`. See docs/models.md, "Adding a model family".

Architecture only: every layer is token-local except its mixer, whose one distributed
call is ``plan.attention`` (or the Gated DeltaNet ring); the loss's reduction over the SP
group lives in :mod:`usp.models.loss`; memory levers (checkpointing, offload, MLP tiles,
head chunks, loss chunks) are applied from outside by :class:`usp.models.Levers`. With
``plan=None`` the same classes run single-process. Parameter names equal HF checkpoint
keys (``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from usp.models import checkpoint as hf_checkpoint
from usp.models.attention import AttentionOptions
from usp.models.config import DecoderConfig
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, sp_cross_entropy, sp_logits_cross_entropy
from usp.models.mixers import MIXER_OF_KIND, MIXERS, mixers_of
from usp.models.mlp import MLP
from usp.models.moe import has_experts, sp_router_aux_loss
from usp.models.parts import Blueprint, LayerParts
from usp.models.plan_inputs import check_attention_options, check_heads, pack_once, plan_argument
from usp.models.stack import DecoderStack
from usp.sp.plan import as_plan


class CausalLM(nn.Module):
    """A decoder-only causal LM whose sequence is sharded over a :class:`usp.Plan`.

    ``plan``: a :class:`usp.Plan`, a :class:`usp.process_groups.Topology` (wrapped in ``usp.Plan(topology,
    **attention_options)``) or ``None`` (single process). Weights are initialised as HF
    does (:meth:`init_weights`) unless built on the meta device. Memory levers:
    :class:`usp.models.Levers` (``Levers(...).apply(model)``).

    ``model(input_ids, *, labels=None, position_ids=None, cu_seqlens=None,
    num_items_in_batch=None, return_aux_loss=False)``:

    * ``input_ids`` [B, S/P]: this rank's shard in the plan's layout (``plan.shard``);
    * ``position_ids``: RoPE positions ([S/P] or [B, S/P]); by default the tokens' global
      positions, restarting at 0 in every document of a packed sequence;
    * ``cu_seqlens``: int32 document boundaries of the *global* packed sequence (B = 1),
      or a ``usp.sp.plan.PackedSequence`` from ``plan.pack``; validated once per forward;
    * without ``labels``: logits [B, S/P, V];
    * with ``labels`` ([B, S/P]: this rank's shard of the globally shifted labels, see
      :func:`usp.models.shift_labels`): the loss, a scalar equal to the mean over every
      non-ignored label of the whole global sequence, identical on every SP rank, whose
      gradient is this rank's share: the SUM over the SP group of each parameter's
      gradient equals the single-process gradient. Logits are never materialised (the
      loss runs ``loss_chunk_tokens`` rows at a time). ``num_items_in_batch``: divide the
      global label sum by this instead of the global label count (gradient
      accumulation: give the count over all micro-batches, then the micro-batch losses
      add up to the mean over all of them). A mixture-of-experts model with
      ``output_router_logits`` (:attr:`adds_aux_loss`) adds ``router_aux_loss_coef`` x
      the load-balancing loss of the whole batch, as transformers does;
    * ``return_aux_loss=True`` (with ``labels``): ``(loss, aux)``, ``aux`` that
      load-balancing loss (detached, before the coefficient; None without it): the
      metrics' ``aux_loss`` column reads it from here.
    """

    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    #: the family's named shapes (``from_config("name")``)
    presets: ClassVar[dict[str, DecoderConfig]] = {}
    #: what every layer of the family's stack shares: its norms, their placement, the
    #: embedding (:class:`usp.models.parts.Blueprint`)
    blueprint: ClassVar[Blueprint] = Blueprint()
    #: why ``[train] compile`` (each decoder layer compiled whole, ``fullgraph=True``)
    #: cannot compile this family's layers yet, for the refusal's message; None: it can
    compile_refusal: ClassVar[str | None] = None

    @staticmethod
    def attention_options(config: DecoderConfig) -> AttentionOptions:
        """The family's attention (:class:`usp.models.attention.AttentionOptions`): here
        HF's ``attention_bias`` on all four projections."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @staticmethod
    def make_mlp(config: DecoderConfig, index: int) -> nn.Module:
        """Layer ``index``'s MLP part (a family with experts, or another activation,
        says)."""
        return MLP(config)

    @classmethod
    def layer_parts(cls, config: DecoderConfig, index: int) -> LayerParts:
        """Layer ``index``'s parts: the mixer of its kind (``config.layer_kinds``), its
        window and RoPE (``config.layer_window``, ``layer_rope``), the family's attention
        options and MLP."""
        mixer = MIXER_OF_KIND[config.layer_kinds[index]]
        return LayerParts(
            mlp=cls.make_mlp(config, index),
            mixer=mixer,
            attention=cls.attention_options(config),
            window=config.layer_window(index),
            rope=config.layer_rope(index) if MIXERS[mixer].uses_rope else None,
        )

    @classmethod
    def kernel_refusal(cls, config: DecoderConfig, plan, device, dtype) -> str | None:
        """Why a kernel ``plan`` forces cannot run this model's layers of ``config`` on
        ``device`` with activations of ``dtype`` (None: they can). Attention's backends are
        chosen per call; a mixer with kernels of its own (Gated DeltaNet) says."""
        for mixer in mixers_of(config):
            refusal = mixer.kernel_refusal and mixer.kernel_refusal(config, plan, device, dtype)
            if refusal:
                return refusal
        return None

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        """The parameter name of a checkpoint key (``None``: a tensor this model does not
        hold); HF names are the parameter names, so this is the key itself unless a
        family reads another layout (e.g. a multimodal checkpoint's language model)."""
        return key

    def __init__(self, config: DecoderConfig, /, plan=None, **attention_options):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"config must be a usp.models.{self.config_class.__name__}, got "
                f"{type(config).__name__}; use {type(self).__name__}.from_config for HF dicts "
                "and preset names"
            )
        plan = plan_argument(plan, attention_options, type(self).__name__)
        check_attention_options(attention_options, type(self).__name__)
        self.config = config
        self.plan = as_plan(plan, **attention_options)
        check_heads(self.plan, config.num_attention_heads, config.num_key_value_heads)
        for mixer in mixers_of(config):  # before any collective
            if mixer.check is not None:
                mixer.check(self.plan, config)
        parts = [self.layer_parts(config, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderStack(config, self.plan, parts, self.blueprint)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        #: rows of logits per chunk of the loss (a lever: usp.models.Levers); None: one pass
        self.loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
        if self.model.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config, /, plan=None, **kwargs) -> CausalLM:
        """From a config of this family, an HF config dict, or a preset name of this
        family; randomly initialised."""
        if isinstance(config, str):
            if config not in cls.presets:
                raise KeyError(
                    f"unknown {cls.config_class.family} preset {config!r}; known: "
                    f"{', '.join(cls.presets)}"
                )
            config = cls.presets[config]
        elif isinstance(config, dict):
            config = cls.config_class.from_hf_dict(config)
        plan = plan_argument(plan, kwargs, f"{cls.__name__}.from_config")
        return cls(config, plan, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        /,
        plan=None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs,
    ) -> CausalLM:
        """Load a local HF-format directory (``config.json`` + ``model.safetensors`` or a
        sharded ``model.safetensors.index.json``); never downloads. The model is built on
        the meta device and the tensors are placed into it one by one (no second copy).
        ``dtype=None`` keeps the checkpoint's dtype; ``device`` defaults to CPU.
        ``config``: the checkpoint's config with other position settings
        (``with_positions``: context extension); anything else that differs from its
        ``config.json`` is an error. ``kwargs`` go to the constructor (attention
        options)."""
        plan = plan_argument(plan, kwargs, f"{cls.__name__}.from_pretrained")
        return hf_checkpoint.load_pretrained(cls, path, plan, dtype=dtype, device=device, **kwargs)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads.
        Call it on one rank (parameters are replicated over SP)."""
        return hf_checkpoint.save_pretrained(self, path)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF's initialisation: linear and embedding weights normal(0, initializer_range),
        biases 0, the pad token's embedding row 0, each norm as its kind starts (1, or 0
        for ``1 + weight``), then what a mixer adds (e.g. after ``to_empty`` from the meta
        device)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif hasattr(module, "init_weights") and module is not self:
                module.init_weights(std, generator)  # norms, sinks, grouped experts, a router
        pad = self.model.embed_tokens.padding_idx
        if pad is not None:
            self.model.embed_tokens.weight[pad].zero_()
        for layer in self.model.layers:
            mixer = MIXERS[layer.mixer_name]
            if mixer.init_weights is not None:
                mixer.init_weights(layer.mixer, std, generator)

    # ------------------------------------------------------------------ structure
    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, in order (what FSDP wraps and levers act on)."""
        return self.model.layers

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, dim]: ``lm_head.weight``, or the embedding with tied embeddings."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def logit_softcap(self) -> float | None:
        """``final_logit_softcapping`` (Gemma 3): logits become ``cap * tanh(logits /
        cap)``; None: the plain projection."""
        return getattr(self.config, "final_logit_softcapping", None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., V]: the logits of final-norm outputs ``hidden`` [..., dim] (any rows):
        the output projection, soft-capped where the config says (token-local, as
        transformers). What code outside the model that turns :meth:`hidden_states` into
        logits calls."""
        logits = F.linear(hidden, self.output_weight)
        cap = self.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens=None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
        return_aux_loss: bool = False,
    ):
        _check_tokens(input_ids, labels, position_ids)
        # MoE families with output_router_logits: the load-balancing term joins the loss
        stats = [] if labels is not None and self.adds_aux_loss else None
        hidden = self.hidden_states(
            input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, router_stats=stats
        )
        if labels is None:
            return self.logits(hidden)  # [B, S/P, V]
        if self.logit_softcap is None:
            loss = sp_cross_entropy(
                hidden,
                self.output_weight,
                labels,
                self.plan.sp_group,
                ignore_index=ignore_index,
                chunk_tokens=self.loss_chunk_tokens,
                num_items_in_batch=num_items_in_batch,
            )
        else:  # capped logits are no plain projection: this rank's are materialised
            loss = sp_logits_cross_entropy(
                self.logits(hidden), labels, self.plan.sp_group, ignore_index=ignore_index,
                num_items_in_batch=num_items_in_batch,
            )  # fmt: skip
        aux = None
        if stats:  # as transformers: CE + coef * aux
            aux = sp_router_aux_loss(
                stats[0], self.config.num_experts, self.plan.sp_group, dtype=loss.dtype
            )
            loss = loss + self.config.router_aux_loss_coef * aux
        if return_aux_loss:
            return loss, (None if aux is None else aux.detach())
        return loss

    @property
    def adds_aux_loss(self) -> bool:
        """Whether the training loss includes the router's load-balancing term (a
        mixture-of-experts config with ``output_router_logits``)."""
        return bool(getattr(self.config, "output_router_logits", False)) and has_experts(self)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens=None,
        router_stats: list | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, S/P, dim] for this rank's tokens (what the output
        projection, :attr:`output_weight`, turns into logits); arguments as ``forward``.
        ``router_stats``: a list that receives this rank's router statistics summed over
        the MoE layers ([2E + 1], :func:`usp.models.moe.router_stats`; nothing without
        experts)."""
        packed = pack_once(self.plan, cu_seqlens, input_ids)
        global_len = input_ids.shape[1] * self.plan.sp_degree if packed is None else packed.seq_len
        if position_ids is None:
            position_ids = self.plan.position_ids(
                global_len, packed=packed, device=input_ids.device
            )
        if router_stats is None:
            return self.model(input_ids, position_ids, packed)  # [B, S/P, dim]
        return self.model(input_ids, position_ids, packed, router_stats=router_stats)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"family={c.family}, layers={c.num_hidden_layers}, dim={c.hidden_size}, "
            f"heads={c.num_attention_heads}/{c.num_key_value_heads}, vocab={c.vocab_size}, "
            f"tied={c.tie_word_embeddings}, sp={self.plan.sp_degree}"
        )


def _check_tokens(input_ids, labels, position_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a [B, S/P] tensor of token ids, got {shape}")
    if input_ids.is_floating_point():
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} differs from input_ids shape "
            f"{tuple(input_ids.shape)}: pass this rank's shard of the globally shifted labels "
            "(usp.models.shift_labels on the whole batch, then plan.shard like the tokens)"
        )
    if position_ids is not None and position_ids.shape not in (
        input_ids.shape,
        input_ids.shape[1:],
    ):
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} must be [S/P] or [B, S/P] "
            f"for input_ids of shape {tuple(input_ids.shape)}"
        )

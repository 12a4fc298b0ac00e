"""The decoder-only architecture every family here shares (Llama's), sequence-parallel
through a :class:`usp.Plan`, with the hooks a family overrides.

Architecture only: every layer is token-local except attention, whose one distributed
call is ``plan.attention``; the loss's reduction over the SP group lives in
:mod:`usp.models.loss`; memory levers (checkpointing, offload, MLP tiles, head chunks,
loss chunks) are applied from outside by :class:`usp.models.Levers`. With ``plan=None``
the same classes run single-process. Parameter names equal HF checkpoint keys
(``model.layers.0.self_attn.q_proj.weight``).

A family (``usp/models/<family>.py``) subclasses :class:`CausalLM` with its config class
and, where its layers differ, its own :class:`Attention` (e.g. Qwen3's per-head norms of
q and k) -- see docs/models.md, "Adding a model family".
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from usp.models import checkpoint as hf_checkpoint
from usp.models.config import DecoderConfig
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, sp_cross_entropy
from usp.models.moe import add_router_stats, has_experts, sp_router_aux_loss, split_layer_output
from usp.models.norm import rms_norm
from usp.models.plan_inputs import check_attention_options, check_heads, pack_once, plan_argument
from usp.models.rope import apply_rope, attention_factor, inverse_frequencies, rope_cos_sin
from usp.sp.plan import as_plan


class RMSNorm(nn.Module):
    """x / rms(x) * weight; normalised in float32 at least (float64 stays float64), then
    cast back before the weight, as HF does for checkpoint fidelity in bf16. Its backward
    keeps only ``x`` and one float32 value per token (:mod:`usp.models.norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention: projections and RoPE on local tokens, USP attention across.

    Family hooks: :meth:`projection_bias` (which projections carry a bias) and
    :meth:`project` (q, k, v from the input, before RoPE)."""

    def __init__(self, config: DecoderConfig, plan):
        super().__init__()
        self.plan = plan
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        dim, q_dim, kv_dim = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        qkv_bias, o_bias = self.projection_bias(config)
        self.q_proj = nn.Linear(dim, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, dim, bias=o_bias)
        # groups of KV heads the ring attends to one after the other: 1 unless a lever
        # (usp.models.Levers.attention_head_chunks) sets it; the same numbers either way
        self.head_chunks = 1
        # a sliding layer's window (a family sets it per layer) and per-head sink logits
        # (a family with sinks makes this an nn.Parameter [H]); None: full, no sinks
        self.window: int | None = None
        self.sinks: torch.Tensor | None = None

    @staticmethod
    def projection_bias(config: DecoderConfig) -> tuple[bool, bool]:
        """(q/k/v bias, output bias): HF's ``attention_bias`` on all four."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def project(self, x: torch.Tensor):
        """x [B, S/P, dim] -> q [B, S/P, H, D], k and v [B, S/P, Hkv, D] (before RoPE)."""
        batch, tokens, _ = x.shape
        q = self.q_proj(x).view(batch, tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed=None):
        batch, tokens, _ = x.shape  # [B, S/P, dim]
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
        )  # fmt: skip  (out [B, S/P, H, D], exact attention over the global sequence)
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). (A tiled variant is a lever:
    :class:`usp.models.Levers` ``mlp_tile_tokens``.)"""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None):
        """``intermediate_size``: ``config.intermediate_size`` unless given (e.g. a
        mixture-of-experts block's shared expert)."""
        super().__init__()
        dim = config.hidden_size
        hidden = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DecoderConfig, plan, attention_class: type[Attention], mlp: nn.Module
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_class(config, plan)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, packed=None):
        """x [B, S/P, dim] -> [B, S/P, dim]; with a mixture-of-experts MLP (x, its router
        statistics [2E + 1]): see :func:`usp.models.moe.split_layer_output`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packed)
        return with_router_stats(x, self.mlp(self.post_attention_layernorm(x)))


def with_router_stats(x: torch.Tensor, mlp_output):
    """A layer's output: ``x`` plus the MLP's output; a mixture-of-experts MLP's router
    statistics ride along (``(x, stats)``), any other layer returns the tensor."""
    out, stats = split_layer_output(mlp_output)
    return x + out if stats is None else (x + out, stats)


def pad_row_embedding(config) -> nn.Embedding:
    """The input embedding with transformers' ``padding_idx``: the pad token's row gets no
    gradient from the input side (Gemma 3, Qwen3.5; a pad id outside the vocabulary, or
    none, gives a plain embedding)."""
    pad = config.pad_token_id
    pad = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
    return nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=pad)


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(
        self, config: DecoderConfig, plan, attention_class: type[Attention], make_mlp=None
    ):
        super().__init__()
        self.config = config
        self.plan = plan
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        make_mlp = make_mlp or (lambda config, index: MLP(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, plan, attention_class, make_mlp(config, index))
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed=None, router_stats=None
    ):
        """input_ids [B, S/P], position_ids [S/P] or [B, S/P] -> hidden [B, S/P, dim].
        ``router_stats``: a list that receives the sum of the MoE layers' router
        statistics ([2E + 1], :func:`usp.models.moe.router_stats`), if any layer has
        experts."""
        x = self.embed_tokens(input_ids)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]  # [1, S/P]: the same positions in every row
        inv_freq = inverse_frequencies(self.config, device=x.device)
        cos, sin = rope_cos_sin(
            position_ids, inv_freq, x.dtype, attention_factor(self.config)
        )  # [B or 1, S/P, head_dim], once for all layers
        total = None
        for layer in self.layers:
            x, stats = split_layer_output(layer(x, cos, sin, packed))
            total = add_router_stats(total, stats)
        if router_stats is not None and total is not None:
            router_stats.append(total)
        return self.norm(x)


#: why a family with sliding-window layers refuses ``[train] compile`` on an all-gather
#: ring (its ``allgather_compile_refusal``): usp train packs documents, and the
#: all-gather ring's windowed call over packed documents does not compile (its
#: per-document gathers would specialise the graph to one packing: usp/sp/attend.py); the
#: p2p ring masks its windowed blocks from device bounds and compiles
#: (usp.ring.masked_window)
WINDOW_COMPILE_REFUSAL = (
    "its sliding-window layers over packed documents compile only on the p2p ring "
    '(with ring_impl = "allgather" and a ring degree > 1 a windowed call is not traced); '
    'set [attention] ring_impl = "p2p"'
)


class CausalLM(nn.Module):
    """A decoder-only causal LM whose sequence is sharded over a :class:`usp.Plan`.

    ``plan``: a :class:`usp.Plan`, a :class:`usp.process_groups.Topology` (wrapped in ``usp.Plan(topology,
    **attention_options)``) or ``None`` (single process). Weights are initialised as HF
    does (normal(0, ``initializer_range``), biases 0, norms 1) unless built on the meta
    device. Memory levers: :class:`usp.models.Levers` (``Levers(...).apply(model)``).

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
    attention_class: ClassVar[type[Attention]] = Attention
    #: the module under ``model.`` (embeddings, layers, final norm); a family whose layers
    #: differ beyond the attention and MLP hooks gives its own (same constructor)
    stack_class: ClassVar[type[nn.Module]] = DecoderStack
    #: the family's named shapes (``from_config("name")``)
    presets: ClassVar[dict[str, DecoderConfig]] = {}
    #: why ``[train] compile`` (each decoder layer compiled whole, ``fullgraph=True``)
    #: cannot compile this family's layers yet, for the refusal's message; None: it can
    compile_refusal: ClassVar[str | None] = None
    #: why it cannot compile them when the ring all-gathers (``ring_impl = "allgather"``,
    #: ring degree > 1); None: it can
    allgather_compile_refusal: ClassVar[str | None] = None

    @classmethod
    def kernel_refusal(cls, config: DecoderConfig, plan, device, dtype) -> str | None:
        """Why a kernel ``plan`` forces cannot run this family's layers of ``config`` on
        ``device`` with activations of ``dtype`` (None: they can). Attention's backends are
        chosen per call; a family with layers of other kernels (Gated DeltaNet) says."""
        return None

    @staticmethod
    def make_mlp(config: DecoderConfig, index: int) -> nn.Module:
        """Layer ``index``'s MLP (a family with other MLPs, e.g. experts, overrides it)."""
        return MLP(config)

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
        self.model = self.stack_class(config, self.plan, self.attention_class, self.make_mlp)
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
        biases 0, norm weights 1 (e.g. after ``to_empty`` from the meta device)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif hasattr(module, "init_weights") and module is not self:
                module.init_weights(std, generator)  # e.g. grouped expert weights, a router

    # ------------------------------------------------------------------ structure
    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, in order (what FSDP wraps and levers act on)."""
        return self.model.layers

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, dim]: ``lm_head.weight``, or the embedding with tied embeddings."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., V]: the logits of final-norm outputs ``hidden`` [..., dim] (any rows):
        the output projection, and whatever a family adds after it (Gemma 3's soft cap).
        What code outside the model that turns :meth:`hidden_states` into logits calls."""
        return F.linear(hidden, self.output_weight)

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
        loss = sp_cross_entropy(
            hidden,
            self.output_weight,
            labels,
            self.plan.sp_group,
            ignore_index=ignore_index,
            chunk_tokens=self.loss_chunk_tokens,
            num_items_in_batch=num_items_in_batch,
        )
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
        if self.config.attention_window is not None:
            self._check_window(global_len, packed)
        if position_ids is None:
            position_ids = self.plan.position_ids(
                global_len, packed=packed, device=input_ids.device
            )
        if router_stats is None:
            return self.model(input_ids, position_ids, packed)  # [B, S/P, dim]
        return self.model(input_ids, position_ids, packed, router_stats=router_stats)

    def _check_window(self, global_len: int, packed) -> None:
        """A sliding-window model is exact here only on documents within its window."""
        if packed is None:
            self.config.check_window(global_len, what="the sequence")
        else:
            longest = max(b - a for a, b in zip(packed.bounds, packed.bounds[1:]))
            self.config.check_window(longest)

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

"""The Llama-3-family architecture (Llama 3, 3.1, 3.2; GQA, RoPE with llama3 scaling,
tied or untied embeddings), sequence-parallel through a :class:`usp.Plan`.

Architecture only: every layer is token-local except attention, whose one distributed
call is ``plan.attention``; the loss's reduction over the SP group lives in
:mod:`usp.models.loss`. With ``topology=None`` the same class runs single-process.
Parameter names equal HF checkpoint keys (``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from usp.models.config import LlamaConfig
from usp.models.labels import IGNORE_INDEX
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, check_chunk_tokens, sp_cross_entropy
from usp.models.mlp_tiles import tiled_swiglu
from usp.models.norm import rms_norm
from usp.models.offload import HostOffloader, check_activation_checkpointing
from usp.models.plans import check_heads, pack_once, ring_kv_heads
from usp.models.rope import apply_rope, attention_factor, inverse_frequencies, rope_cos_sin
from usp.plan import as_plan


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
    """GQA self-attention: projections and RoPE on local tokens, USP attention across."""

    def __init__(self, config: LlamaConfig, plan):
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
        self.q_proj = nn.Linear(dim, q_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, dim, bias=False)
        self.head_chunks = 1  # groups of KV heads attended one after the other (see Llama)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed=None):
        batch, tokens, _ = x.shape  # [B, S/P, dim]
        q = self.q_proj(x).view(batch, tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.plan.attention(
            q,
            k,
            v,
            causal=True,
            softmax_scale=self.head_dim**-0.5,
            packed=packed,
            head_chunks=self.head_chunks,
        )  # fmt: skip  (out [B, S/P, H, D], exact attention over the global sequence)
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)).

    ``tile_tokens`` (0: off): run over tiles of that many local tokens (the batch and
    sequence dims flattened) in one autograd function that keeps only ``x`` and the
    weights and recomputes each tile in backward (:mod:`usp.models.mlp_tiles`), so
    that only one tile's ``[tokens, intermediate]`` activations exist at a time, in
    forward and in backward. The result equals the untiled MLP up to float rounding
    (the weight gradients are summed over tiles). Inputs of at most ``tile_tokens``
    tokens run the untiled MLP.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        dim, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.tile_tokens = 0

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[:-1].numel()
        if not self.tile_tokens or tokens <= self.tile_tokens:
            return self.swiglu(x)
        # the Linears' own weights, as their forward reads them (under FSDP2: the
        # unsharded parameters, set by the decoder layer's pre-forward hook)
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return tiled_swiglu(x, *weights, self.tile_tokens)  # [B, S/P, dim]


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, plan):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, plan)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, packed=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packed)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: LlamaConfig, plan):
        super().__init__()
        self.config = config
        self.plan = plan
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, plan) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.activation_checkpointing: bool | str = False  # see usp.models.offload
        self.offloader = HostOffloader()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed=None):
        """input_ids [B, S/P], position_ids [S/P] or [B, S/P] -> hidden [B, S/P, dim]."""
        x = self.embed_tokens(input_ids)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]  # [1, S/P]: the same positions in every row
        inv_freq = inverse_frequencies(self.config, device=x.device)
        cos, sin = rope_cos_sin(
            position_ids, inv_freq, x.dtype, attention_factor(self.config)
        )  # [B or 1, S/P, head_dim], once for all layers
        mode = self.activation_checkpointing if torch.is_grad_enabled() else False
        for layer in self.layers:
            if mode == "offload":  # as below, the kept input living in host memory
                with self.offloader.hold(x):
                    x = checkpoint(layer, x, cos, sin, packed, use_reentrant=False)
            elif mode:  # keep only the layer's input; backward re-runs it (and its collectives)
                x = checkpoint(layer, x, cos, sin, packed, use_reentrant=False)
            else:
                x = layer(x, cos, sin, packed)
        return self.norm(x)


class Llama(nn.Module):
    """A Llama-3-family causal LM whose sequence is sharded over a :class:`usp.Plan`.

    ``topology``: a :class:`usp.Topology` (wrapped in ``usp.Plan(topology,
    **attention_options)``), a :class:`usp.Plan`, or ``None`` (single process).
    ``activation_checkpointing``: ``True`` recomputes each decoder layer in backward
    (non-reentrant), keeping only its input; ``"offload"`` keeps that input in host memory
    (pinned, copied on a side stream on CUDA; :mod:`usp.models.offload`).
    ``mlp_tile_tokens``: 0 (off) or N: each MLP runs over tiles of N local tokens, each
    recomputed in backward, so only one tile's ``[N, intermediate]`` activations exist
    (:mod:`usp.models.mlp_tiles`).
    ``attention_head_chunks``: 1 (off) or N dividing the KV heads each rank's ring
    attends to (Hkv after KV replication, / ulysses): the ring runs once per group of
    those heads, so its float32 accumulators and K/V buffers exist for one group at a
    time (:mod:`usp.ring.heads`); the same numbers.
    ``loss_chunk_tokens``: tokens per chunk of the output projection in the loss (``None``:
    one unchunked pass). Weights are initialised as HF does (normal(0,
    ``initializer_range``), norms 1) unless built on the meta device.

    ``model(input_ids, *, labels=None, position_ids=None, cu_seqlens=None,
    num_items_in_batch=None)``:

    * ``input_ids`` [B, S/P]: this rank's shard in the plan's layout (``plan.shard``);
    * ``position_ids``: RoPE positions ([S/P] or [B, S/P]); by default the tokens' global
      positions, restarting at 0 in every document of a packed sequence;
    * ``cu_seqlens``: int32 document boundaries of the *global* packed sequence (B = 1),
      or a ``usp.PackedSequence`` from ``plan.pack``; validated once per forward;
    * without ``labels``: logits [B, S/P, V];
    * with ``labels`` ([B, S/P]: this rank's shard of the globally shifted labels, see
      :func:`usp.models.shift_labels`): the loss, a scalar equal to the mean over every
      non-ignored label of the whole global sequence, identical on every SP rank, whose
      gradient is this rank's share: the SUM over the SP group of each parameter's
      gradient equals the single-process gradient. Logits are never materialised.
      ``num_items_in_batch``: divide the global label sum by this instead of the global
      label count (gradient accumulation: give the count over all micro-batches, then the
      micro-batch losses add up to the mean over all of them).
    """

    def __init__(
        self,
        config: LlamaConfig,
        topology=None,
        *,
        activation_checkpointing: bool | str = False,
        mlp_tile_tokens: int = 0,
        attention_head_chunks: int = 1,
        loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
        **attention_options,
    ):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(
                f"config must be a usp.models.LlamaConfig, got {type(config).__name__}; "
                "use Llama.from_config for HF dicts"
            )
        self.config = config
        self.plan = as_plan(topology, **attention_options)
        check_heads(self.plan, config.num_attention_heads, config.num_key_value_heads)
        self.model = LlamaModel(config, self.plan)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.activation_checkpointing = activation_checkpointing
        self.mlp_tile_tokens = mlp_tile_tokens
        self.attention_head_chunks = attention_head_chunks
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        if self.model.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config, topology=None, **kwargs) -> Llama:
        """From a :class:`LlamaConfig`, an HF config dict, or a preset name
        (``usp.models.PRESETS``); randomly initialised."""
        from usp.models.presets import preset

        if isinstance(config, str):
            config = preset(config)
        elif isinstance(config, dict):
            config = LlamaConfig.from_hf_dict(config)
        return cls(config, topology, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        topology=None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs,
    ) -> Llama:
        """Load a local HF-format directory (``config.json`` + ``model.safetensors`` or a
        sharded ``model.safetensors.index.json``); never downloads. The model is built on
        the meta device and the tensors are placed into it one by one (no second copy).
        ``dtype=None`` keeps the checkpoint's dtype; ``device`` defaults to CPU.
        ``config``: the checkpoint's :class:`LlamaConfig` with other position settings
        (``LlamaConfig.with_positions``: context extension); anything else that differs
        from its ``config.json`` is an error. ``kwargs`` go to the constructor
        (``activation_checkpointing``, ``mlp_tile_tokens``, attention options)."""
        from usp.models.checkpoint import load_pretrained

        return load_pretrained(cls, path, topology, dtype=dtype, device=device, **kwargs)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` that ``transformers`` loads.
        Call it on one rank (parameters are replicated over SP)."""
        from usp.models.checkpoint import save_pretrained

        return save_pretrained(self, path)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF's initialisation: linear and embedding weights normal(0, initializer_range),
        norm weights 1 (e.g. after ``to_empty`` from the meta device)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    # ------------------------------------------------------------------ forward
    @property
    def activation_checkpointing(self) -> bool | str:
        """False, True or "offload" (see the class docstring)."""
        return self.model.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: bool | str) -> None:
        self.model.activation_checkpointing = check_activation_checkpointing(value)

    @property
    def mlp_tile_tokens(self) -> int:
        """0 (untiled) or the local tokens per MLP tile, the same in every layer."""
        return self.model.layers[0].mlp.tile_tokens if len(self.model.layers) else 0

    @mlp_tile_tokens.setter
    def mlp_tile_tokens(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"mlp_tile_tokens must be an integer >= 0 (0: untiled; N: tiles of N local "
                f"tokens), got {value!r}"
            )
        for layer in self.model.layers:
            layer.mlp.tile_tokens = value

    @property
    def attention_head_chunks(self) -> int:
        """1 (one pass) or the groups of KV heads each ring pass attends to in turn."""
        return self.model.layers[0].self_attn.head_chunks if len(self.model.layers) else 1

    @attention_head_chunks.setter
    def attention_head_chunks(self, value: int) -> None:
        local = ring_kv_heads(self.plan, self.config.num_attention_heads,
                              self.config.num_key_value_heads)  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or local % value:
            divisors = [n for n in range(1, local + 1) if local % n == 0]
            raise ValueError(
                f"attention_head_chunks must divide the {local} KV heads each rank's ring "
                f"attends to (KV heads after replication / ulysses): one of {divisors}, got "
                f"{value!r}"
            )
        for layer in self.model.layers:
            layer.self_attn.head_chunks = value

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, dim]: ``lm_head.weight``, or the embedding with tied embeddings."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

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
        _check_tokens(input_ids, labels, position_ids)
        packed = pack_once(self.plan, cu_seqlens, input_ids)
        if position_ids is None:
            global_len = input_ids.shape[1] * self.plan.sp_degree
            position_ids = self.plan.position_ids(
                global_len, packed=packed, device=input_ids.device
            )
        hidden = self.model(input_ids, position_ids, packed)  # [B, S/P, dim]
        if labels is None:
            return F.linear(hidden, self.output_weight)  # [B, S/P, V]
        return sp_cross_entropy(
            hidden,
            self.output_weight,
            labels,
            self.plan.sp_group,
            ignore_index=ignore_index,
            chunk_tokens=self.loss_chunk_tokens,
            num_items_in_batch=num_items_in_batch,
        )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layers={c.num_hidden_layers}, dim={c.hidden_size}, heads={c.num_attention_heads}/"
            f"{c.num_key_value_heads}, vocab={c.vocab_size}, tied={c.tie_word_embeddings}, "
            f"sp={self.plan.sp_degree}, activation_checkpointing={self.activation_checkpointing}, "
            f"mlp_tile_tokens={self.mlp_tile_tokens}, "
            f"attention_head_chunks={self.attention_head_chunks}"
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

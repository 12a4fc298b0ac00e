"""LoRA: low-rank adapters on a frozen base model, under sequence parallelism.

    lora = usp.models.Lora(rank=16, alpha=32, dropout=0.0)   # targets: every projection
    apply_lora(model, lora, seed=0)      # a usp model of any family, before FSDP2/levers

Each target ``nn.Linear`` (HF's module names, matched against the last part of the
module's name inside the decoder layers; the default targets are the family's names for
its attention and MLP projections, :func:`default_targets`) computes, as PEFT's LoRA does,

    y = x @ W.T (+ bias) + (drop(x) @ A.T) @ B.T * (alpha / rank)

with ``A`` [rank, in] and ``B`` [out, rank] registered on the Linear as ``lora_A`` and
``lora_B`` (so its base parameter names stay the HF checkpoint's keys). Every other
parameter -- the Linear's weight and bias, norms, embeddings, the output projection --
is frozen (``requires_grad = False``): it gets no gradient and no optimizer state.

* **Initialisation** as PEFT's default: ``A`` from ``kaiming_uniform_(a=sqrt(5))`` (i.e.
  U(-1/sqrt(in), 1/sqrt(in))), ``B`` zero, so the adapted model starts as the base model.
  The draws are reproducible: one ``torch.Generator`` seeded with ``seed`` draws every
  ``A`` in float32 in the order of :func:`adapted_modules` (the model's module order),
  each then cast to the adapter's dtype (:func:`initial_adapters`).
* **Dtypes.** Adapters are float32 (float64 on a float64 model); they are cast to the
  input's dtype in the forward (FSDP2's mixed precision does it for a sharded model).
  Under FSDP2, :func:`usp.train.parallelize.fully_shard_model` keeps the frozen base in
  the compute dtype (no float32 master copy of weights that never change).
* **Dropout** (``dropout > 0``) is active in training mode with grad enabled (not in a
  held-out evaluation under ``no_grad``). Its masks are keyed by each token's place in
  the training data (:mod:`usp.models.lora_dropout`), so they are the same on one
  process and on any grid: the model's forward takes this rank's tokens' global
  indices from its plan, and :func:`set_stream_position` says where the next forward's
  row starts in the data (the trainer sets it every step; otherwise rows follow on
  from 0). A forward's backward, activation recompute included, must run before the
  next training forward (as in :class:`usp.train.step.TrainStep`).
* **Levers**: activation checkpointing and offload wrap whole layers (nothing to do);
  the tiled MLP (``mlp_tile_tokens``) computes the MLP's adapters per tile in its own
  backward (:class:`usp.models.mlp_tiles.LowRank`, via :func:`low_rank`).

Mixture-of-experts models (:mod:`usp.models.moe`): the attention projections (and the
dense MLPs of ``mlp_only_layers``, named like the experts' projections) take adapters;
targets naming the experts' projections are refused (:data:`EXPERT_TARGETS`).

Export (:mod:`usp.models.lora_export`): a PEFT adapter directory and merged weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from usp.errors import InputError, ModelConfigError
from usp.models.family import decoder_layers, family_of
from usp.models.lora_dropout import apply_mask, keep_mask, module_salt
from usp.models.mlp_tiles import LowRank
from usp.models.moe import has_experts

#: the default targets: every projection of the decoder layers (attention and MLP), as
#: QLoRA found best and as the usp issue proposed; HF's module names
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: targets that would name a mixture-of-experts model's experts (refused there)
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "experts", "gate")
#: the adapter parameters' names on a target Linear
ADAPTER_NAMES = ("lora_A", "lora_B")


class LoraError(InputError):
    """A LoRA setting this model cannot take; the message says what can."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Lora:
    """LoRA's settings (``[train] lora``): see the module docstring."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)

    def __post_init__(self) -> None:
        if not (_is_int(self.rank) and self.rank >= 1):
            raise LoraError(f"rank must be an integer >= 1, got {self.rank!r}")
        alpha = self.alpha
        if not (
            (_is_int(alpha) or isinstance(alpha, float)) and math.isfinite(alpha) and alpha > 0
        ):
            raise LoraError(f"alpha must be a number > 0, got {alpha!r}")
        p = self.dropout
        if not ((_is_int(p) or isinstance(p, float)) and 0 <= p < 1):
            raise LoraError(f"dropout must be a number in [0, 1), got {p!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not (
            isinstance(targets, (list, tuple))
            and targets
            and all(isinstance(t, str) and t for t in targets)
            and len(set(targets)) == len(targets)
        ):
            raise LoraError(
                "targets must be a non-empty list of distinct module names such as "
                f"{list(DEFAULT_TARGETS)}, got {self.targets!r}"
            )
        object.__setattr__(self, "alpha", float(alpha))
        object.__setattr__(self, "dropout", float(p))
        object.__setattr__(self, "targets", tuple(targets))

    @property
    def scale(self) -> float:
        """``alpha / rank``: what multiplies the adapters' product."""
        return self.alpha / self.rank

    def describe(self) -> str:
        return (
            f"rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, targets "
            + ", ".join(self.targets)
        )


def lora_from_table(value) -> Lora | None:
    """``[train] lora`` as a :class:`Lora`: a table of its fields (``{}``: the defaults),
    ``true`` (the defaults), ``false`` or None (no LoRA); a :class:`LoraError` naming the
    key (``lora.rank must be ...``) otherwise."""
    if value is None or value is False:
        return None
    if value is True:
        return Lora()
    if isinstance(value, Lora):
        return value
    if not isinstance(value, dict):
        raise LoraError(
            f"lora must be a table such as {{rank = 16, alpha = 32}}, true or false, got {value!r}"
        )
    known = [f.name for f in fields(Lora)]
    unknown = [key for key in value if key not in known]
    if unknown:
        raise LoraError(f"lora: unknown key {unknown[0]!r}; expected one of {', '.join(known)}")
    try:
        return Lora(**value)
    except LoraError as err:
        raise LoraError(f"lora.{err}") from None


# ----------------------------------------------------------------------------- the model
def adapted_modules(model: nn.Module, targets) -> list[tuple[str, nn.Linear]]:
    """``(name, Linear)`` of every target in ``model``'s decoder layers, in module order;
    a :class:`LoraError` for a target no decoder layer has (naming the ones it has)."""
    prefix = {id(layer): name for name, layer in model.named_modules()}
    found, seen, linears = [], set(), set()
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            short = name.rpartition(".")[2]
            linears.add(short)
            if short in targets:
                found.append((f"{prefix[id(layer)]}.{name}", module))
                seen.add(short)
    missing = [t for t in targets if t not in seen]
    if missing:
        raise LoraError(
            f"targets {missing} name no Linear module of the decoder layers of "
            f"{type(model).__name__}; its Linear modules are {sorted(linears)} (the output "
            "projection and the embeddings take no adapter here)"
        )
    return found


def apply_lora(model: nn.Module, lora: Lora, *, seed: int = 0) -> nn.Module:
    """Freeze ``model`` (a usp model of any family) and give every target Linear its
    adapters (in place; returns it). Built on the meta device, the adapters stay
    uninitialised (fill them with :func:`initial_adapters` once the model is on its
    device). Apply before the levers, ``torch.compile`` and FSDP2."""
    if not isinstance(lora, Lora):
        raise LoraError(f"lora must be a usp.models.Lora, got {type(lora).__name__}")
    try:
        family_of(model)  # a usp model: its plan keys the dropout, its layers are known
    except ModelConfigError:
        raise LoraError(
            f"apply_lora takes a usp model (usp.models: {type(model).__name__} is none); "
            "for an HF transformers model use peft.get_peft_model (pip install usp[peft])"
        ) from None
    if lora_of(model) is not None:
        raise LoraError("this model already has LoRA adapters")
    if lora.targets == DEFAULT_TARGETS:  # the same projections under the family's names
        lora = replace(lora, targets=default_targets(model))
    on_experts = [t for t in lora.targets if t in EXPERT_TARGETS]
    if on_experts and has_experts(model):
        raise LoraError(
            f"targets {list(on_experts)} name MLP projections, which are experts (grouped "
            f"weights, not Linear modules) in this mixture-of-experts "
            f"{type(model).__name__}: LoRA adapters on experts are not supported; use "
            'targets = ["q_proj", "k_proj", "v_proj", "o_proj"]'
        )
    modules = adapted_modules(model, lora.targets)
    for param in model.parameters():
        param.requires_grad_(False)
    stream = _Stream()
    for index, (_, linear) in enumerate(modules):
        weight = linear.weight
        dtype = torch.promote_types(weight.dtype, torch.float32)
        for name, shape in zip(ADAPTER_NAMES, _adapter_shapes(linear, lora.rank)):
            empty = torch.empty(shape, dtype=dtype, device=weight.device)
            linear.register_parameter(name, nn.Parameter(empty))
        linear.forward = _LoraForward(linear, lora, module_salt(seed, index), stream)
    model.usp_lora = lora
    model.usp_lora_stream = stream
    if lora.dropout > 0:
        model.register_forward_pre_hook(stream.before_forward, with_kwargs=True)
    if next(model.parameters()).device.type != "meta":
        with torch.no_grad():
            for name, value in initial_adapters(model, seed).items():
                model.get_parameter(name).copy_(value)
    return model


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """The targets a :class:`Lora` with the default ones adapts on ``model``: every
    attention and MLP projection under its family's names (:data:`DEFAULT_TARGETS`, or
    the model class's ``lora_default_targets``: Granite's fused MLP is ``input_linear``,
    ``output_linear``)."""
    return tuple(getattr(model, "lora_default_targets", DEFAULT_TARGETS))


def _adapter_shapes(linear: nn.Linear, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (rank, linear.in_features), (linear.out_features, rank)


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' initial values (full, unsharded: parameter name -> tensor on the
    CPU, in the adapter's dtype): ``A`` drawn as the module docstring says, ``B`` zero."""
    lora = lora_of(model)
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for name, linear in adapted_modules(model, lora.targets):
        a_shape, b_shape = _adapter_shapes(linear, lora.rank)
        a = torch.empty(a_shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        dtype = linear.lora_A.dtype
        values[f"{name}.lora_A"] = a.to(dtype)
        values[f"{name}.lora_B"] = torch.zeros(b_shape, dtype=dtype)
    return values


def lora_of(model: nn.Module) -> Lora | None:
    """The LoRA settings applied to ``model`` (None: no adapters)."""
    return getattr(model, "usp_lora", None)


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state-dict key) name is an adapter's."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def set_stream_position(model: nn.Module, first_token: int) -> None:
    """The next training forward's first token is token ``first_token`` of the training
    data stream (its global sequence index times ``seq_len``); the forwards after it
    follow on (each advances the position by its rows' tokens). Keys the dropout masks;
    a no-op for a model without LoRA dropout."""
    stream = getattr(model, "usp_lora_stream", None)
    if stream is not None:
        stream.next_token = int(first_token)


def low_rank(linear: nn.Module, x: torch.Tensor) -> LowRank | None:
    """The adapter of ``linear`` as the tiled MLP takes it, for the input ``x`` [..., in]
    of this forward (None without one): factors in ``x``'s dtype, the dropout's mask of
    any rows of the flattened tokens."""
    forward = linear.__dict__.get("forward")
    if not isinstance(forward, _LoraForward):
        return None
    a, b = linear.lora_A.to(x.dtype), linear.lora_B.to(x.dtype)
    keep = forward.mask_of(x)
    p = 0.0 if keep is None else forward.lora.dropout
    return LowRank(a, b, forward.lora.scale, keep, p)


# ----------------------------------------------------------------------------- forward
class _Stream:
    """Where this forward's tokens sit in the training data (for the dropout masks)."""

    def __init__(self):
        self.next_token = 0  # the next training forward's first token
        self.tokens: torch.Tensor | None = None  # int64 [B * S/P]: this forward's tokens

    def before_forward(self, model, args, kwargs):
        """The model's forward pre-hook: this rank's tokens' stream indices."""
        if not (model.training and torch.is_grad_enabled()):
            return
        input_ids = args[0] if args else kwargs["input_ids"]
        batch, local = input_ids.shape
        plan, packed = model.plan, kwargs.get("cu_seqlens")
        seq = local * plan.sp_degree  # the global row length
        if packed is not None and plan.placement == "documents":  # ranks hold different counts
            seq = plan.shard_packing(packed, local).seq_len
        in_row = plan.token_indices(seq, packed=packed, device=input_ids.device)
        rows = torch.arange(batch, dtype=torch.int64, device=input_ids.device)[:, None] * seq
        self.tokens = (rows + in_row[None] + self.next_token).reshape(-1)  # [B * S/P]
        self.next_token += batch * seq

    def tokens_for(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if self.tokens is None or self.tokens.shape[0] != rows:
            raise LoraError(
                f"LoRA dropout keys its masks by the tokens of the model's forward, but this "
                f"call has {rows} tokens and the last training forward "
                f"{'none' if self.tokens is None else self.tokens.shape[0]}: call the whole "
                "model (not a layer) in training mode, or set dropout = 0"
            )
        return self.tokens


class _LoraForward:
    """A target Linear's forward: the base projection plus the adapters' (PEFT's order)."""

    def __init__(self, linear: nn.Linear, lora: Lora, salt: int, stream: _Stream):
        self.linear, self.lora, self.salt, self.stream = linear, lora, salt, stream

    def mask_of(self, x: torch.Tensor):
        """None (no dropout now), or rows -> the keep mask [rows, in] of the Linear's
        input for those rows of this forward's tokens (``x`` [..., *]: its tokens)."""
        if not (self.lora.dropout > 0 and self.linear.training and torch.is_grad_enabled()):
            return None
        tokens = self.stream.tokens_for(x)  # captured: a recompute sees this forward's
        features, p, salt = self.linear.in_features, self.lora.dropout, self.salt
        return lambda rows: keep_mask(tokens[rows], features, p, salt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        out = F.linear(x, linear.weight, linear.bias)
        a, b = linear.lora_A.to(x.dtype), linear.lora_B.to(x.dtype)
        keep = self.mask_of(x)
        if keep is not None:
            x = apply_mask(x, keep(slice(None)), self.lora.dropout)
        return out + F.linear(F.linear(x, a), b) * self.lora.scale

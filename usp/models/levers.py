"""Memory levers as one object applied to a model from outside.

A :class:`Levers` names every activation-memory option a decoder model has under usp;
``Levers(...).apply(model)`` sets them on a usp model (any family) or an HF causal LM
whose decoder layers usp can find (:func:`usp.models.family.decoder_layers`). The model
files hold architecture only; the trainer applies the ``[train]`` levers, and the
planner's search space is this class's values (:mod:`usp.planner.search`).

* ``activation_checkpointing``: ``False``, ``True`` (each decoder layer keeps only its
  input; backward re-runs it, collectives included: non-reentrant
  ``torch.utils.checkpoint``) or ``"offload"`` (that input lives in host memory between
  forward and recompute: :mod:`usp.models.offload`). Applied by wrapping each layer's
  ``forward`` (parameter names, hooks and FSDP2 wrapping stay as they are); apply before
  ``torch.compile`` and before FSDP2.
* ``mlp_tile_tokens``: 0 (off) or N: every MLP part runs over tiles of N local tokens,
  each recomputed in backward, so only one tile's ``[N, intermediate]`` activations
  exist: a gated MLP (SwiGLU, usp's GeGLU: :mod:`usp.models.mlp_tiles`; an HF MLP needs
  ``gate_proj``/``up_proj``/``down_proj`` without bias and SiLU, others are refused),
  with its LoRA adapters (:mod:`usp.models.lora`) per tile too; a mixture of experts'
  routed rows, N tokens' worth at a time (:func:`usp.models.moe_op.tiled_experts`, any
  kind of expert: SwiGLU, gpt-oss's clamped SwiGLU), and its shared expert.
* ``attention_head_chunks``: 1 (off) or N dividing the KV heads each rank's ring attends
  to (Hkv after KV replication, / ulysses): the ring runs once per group of those
  heads, so its float32 accumulators and K/V buffers exist for one group at a time
  (:mod:`usp.ring.heads`).
* ``loss_chunk_tokens``: rows per chunk of the output projection in the loss
  (:mod:`usp.models.loss`; ``None``: one unchunked pass).
* ``offload_optimizer``: AdamW's state lives in host memory and its step runs on the
  host (:class:`usp.train.host_optimizer.HostAdamW`, built by the trainer's
  ``build_optimizer``); the parameters stay on the device.
* ``offload_parameters`` (needs ``offload_optimizer``): FSDP2's ``CPUOffloadPolicy`` --
  the sharded parameters and their gradients live in host memory, copied to the device
  for each all-gather (:func:`usp.train.parallelize.fully_shard_model`); the optimizer
  then steps on the host, where its parameters are.

The last two are passed with the levers to whatever shards the model and builds its
optimizer (the trainer and the planner pass the one ``Levers`` explicitly); ``apply``
only records them (:func:`levers_of` shows what was applied). Every option computes the same
numbers (up to float rounding of sums over tiles).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from usp.errors import InputError
from usp.models.decoder import CausalLM
from usp.models.family import decoder_layers
from usp.models.hf_mixers import check_model
from usp.models.lora import low_rank
from usp.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, check_chunk_tokens
from usp.models.mlp_tiles import tiled_glu
from usp.models.moe import is_moe
from usp.models.offload import HostOffloader
from usp.models.plan_inputs import ring_kv_heads


class LeverError(InputError):
    """A lever this model (or this plan) cannot take; the message says which values can.
    A value no model could take (:meth:`invalid`) names its ``key``, the ``expected``
    values and the ``value`` given, so that a config can word it as its own errors."""

    def __init__(self, message: str, *, key: str | None = None, expected=None, value=None):
        super().__init__(message)
        self.key, self.expected, self.value = key, expected, value

    @classmethod
    def invalid(cls, key: str, expected: str, value) -> LeverError:
        return cls(
            f"{key} must be {expected}, got {value!r}", key=key, expected=expected, value=value
        )


@dataclass(frozen=True)
class Levers:
    """The memory levers of one model (see the module docstring for each)."""

    activation_checkpointing: bool | str = False
    mlp_tile_tokens: int = 0
    attention_head_chunks: int = 1
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS
    offload_optimizer: bool = False
    offload_parameters: bool = False

    def __post_init__(self) -> None:
        # the one validation of these values (usp train's [train] keys are checked here too)
        checkpointing = self.activation_checkpointing
        if not (isinstance(checkpointing, bool) or checkpointing == "offload"):
            raise LeverError.invalid(
                "activation_checkpointing",
                'true, false or "offload" (each layer\'s input kept in host memory)',
                checkpointing,
            )
        try:
            check_chunk_tokens(self.loss_chunk_tokens)
        except ValueError as err:
            raise LeverError(str(err)) from None
        if not _count(self.mlp_tile_tokens, minimum=0):
            expected = "an integer >= 0 (0: untiled; N: tiles of N local tokens)"
            raise LeverError.invalid("mlp_tile_tokens", expected, self.mlp_tile_tokens)
        if not _count(self.attention_head_chunks, minimum=1):
            expected = "an integer >= 1"
            raise LeverError.invalid("attention_head_chunks", expected, self.attention_head_chunks)
        for name in ("offload_optimizer", "offload_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise LeverError.invalid(name, "true or false", getattr(self, name))
        if self.offload_parameters and not self.offload_optimizer:
            raise LeverError.invalid(
                "offload_parameters",
                "false unless offload_optimizer = true (the parameters on the host take their "
                "optimizer step there)",
                self.offload_parameters,
            )

    def replace(self, **changes) -> Levers:
        return replace(self, **changes)

    def describe(self) -> str:
        """One line, e.g. ``checkpointing offload, MLP tiles 8192, head chunks 2``."""
        parts = [f"checkpointing {_mode(self.activation_checkpointing)}"]
        if self.mlp_tile_tokens:
            parts.append(f"MLP tiles {self.mlp_tile_tokens}")
        if self.attention_head_chunks > 1:
            parts.append(f"head chunks {self.attention_head_chunks}")
        chunk = self.loss_chunk_tokens
        parts.append("loss unchunked" if chunk is None else f"loss chunks {chunk}")
        if self.offload_optimizer:
            parts.append(
                "parameters and optimizer on the host"
                if self.offload_parameters
                else "optimizer on the host"
            )
        return ", ".join(parts)

    @property
    def offload(self) -> str:
        """``"none"``, ``"optimizer"`` or ``"parameters"`` (parameters, their gradients
        and the optimizer): what of the training state lives in host memory."""
        if self.offload_parameters:
            return "parameters"
        return "optimizer" if self.offload_optimizer else "none"

    # ------------------------------------------------------------------ applying
    def check(self, model: nn.Module, plan=None) -> None:
        """A :class:`LeverError` when ``model`` (on ``plan``) cannot take these levers."""
        config = model.config
        plan = plan if plan is not None else getattr(model, "plan", None)
        if self.attention_head_chunks > 1:
            if plan is None:
                raise LeverError("attention_head_chunks > 1 needs the model's usp.Plan")
            local = ring_kv_heads(
                plan, config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                or config.num_attention_heads,
            )  # fmt: skip
            if local % self.attention_head_chunks:
                divisors = [n for n in range(1, local + 1) if local % n == 0]
                raise LeverError(
                    f"attention_head_chunks must divide the {local} KV heads each rank's ring "
                    f"attends to (KV heads after replication / ulysses): one of {divisors}, got "
                    f"{self.attention_head_chunks!r}"
                )
        if self.mlp_tile_tokens:
            for index, layer in enumerate(decoder_layers(model)):
                _check_tiles(_mlp_of(layer, index))
        if plan is not None and not isinstance(model, CausalLM):
            check_model(model, plan)  # an HF model under SP: token mixers outside attention

    def apply(
        self, model: nn.Module, plan=None, *, offloader: HostOffloader | None = None
    ) -> nn.Module:
        """Set these levers on ``model`` (in place; returns it). Applying again replaces
        the previous levers. ``plan``: the plan the model runs on (a usp model's own by
        default; an HF model's is the one its attention was registered with).
        ``offloader``: where ``activation_checkpointing = "offload"`` keeps the layers'
        inputs (default: a new :class:`usp.models.offload.HostOffloader`; the planner
        passes one whose host copies go to its stand-in host device)."""
        self.check(model, plan)
        if self.activation_checkpointing == "offload":
            offloader = offloader if offloader is not None else HostOffloader()
        else:
            offloader = None
        for index, layer in enumerate(decoder_layers(model)):
            _wrap(layer, _Checkpointed, self.activation_checkpointing, offloader)
            if self.mlp_tile_tokens or hasattr(layer, "mlp"):
                _set_tiles(_mlp_of(layer, index), self.mlp_tile_tokens)
            attention = getattr(layer, "self_attn", None)  # hybrid models: some layers lack one
            if attention is not None:
                attention.head_chunks = self.attention_head_chunks
        model.loss_chunk_tokens = self.loss_chunk_tokens
        model.usp_levers = self
        return model


def tile_mlp(mlp: nn.Module, tile: int) -> nn.Module:
    """Tile one MLP part as ``mlp_tile_tokens = tile`` tiles every layer's (``0``:
    untiled again); returns it."""
    if not _count(tile, minimum=0):
        raise LeverError(f"tile must be an integer >= 0, got {tile!r}")
    if tile:
        _check_tiles(mlp)
    _set_tiles(mlp, tile)
    return mlp


def _check_tiles(mlp: nn.Module) -> None:
    """A LeverError unless every part of ``mlp`` tiles: a gated MLP, or usp's mixture of
    experts (its experts and its shared expert)."""
    if not is_moe(mlp):
        _glu_weights(mlp)
    elif mlp.shared_expert is not None:
        _glu_weights(mlp.shared_expert)


def _set_tiles(mlp: nn.Module, tile: int) -> None:
    """Tile ``mlp``'s parts by ``tile`` tokens (0: untiled)."""
    if is_moe(mlp):
        mlp.experts.tile_tokens = tile
        if mlp.shared_expert is not None:
            _wrap(mlp.shared_expert, _TiledMLP, tile)
    else:
        _wrap(mlp, _TiledMLP, tile)


def levers_of(model: nn.Module) -> Levers:
    """The levers last applied to ``model`` (the defaults if none were)."""
    return getattr(model, "usp_levers", Levers())


def _count(value, *, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _mode(value) -> str:
    return "offload" if value == "offload" else ("on" if value else "off")


# ---------------------------------------------------------------------- forward wrappers
class _LeverForward:
    """A module's ``forward`` replaced by a lever; ``inner`` is the forward it wraps."""

    def __init__(self, inner):
        self.inner = inner


def _wrap(module: nn.Module, kind: type[_LeverForward], setting, *args) -> None:
    """Give ``module`` a ``kind`` forward for ``setting`` (none when falsy), over its
    plain forward (a previous lever's wrapper is taken off first)."""
    current = module.__dict__.get("forward")
    if isinstance(current, _LeverForward) and _is_plain(module, current.inner):
        del module.forward  # back to the class's forward
    elif current is not None:
        raise LeverError(
            f"{type(module).__name__}.forward was replaced by something else (torch.compile?): "
            "apply levers before compiling"
        )
    if setting:
        module.forward = kind(module.forward, setting, *args)


def _is_plain(module: nn.Module, forward) -> bool:
    """Whether ``forward`` is ``module``'s own class forward (not a compiled one)."""
    return (
        getattr(forward, "__self__", None) is module
        and getattr(forward, "__func__", None) is type(module).forward
    )


def compile_forward(module: nn.Module, compile_fn) -> None:
    """Replace ``module``'s own forward by ``compile_fn(forward)``, inside a lever's
    wrapper when it has one: the compiled graph is what a checkpointed layer recomputes,
    and the offload's saved-tensor hooks (which ``torch.compile(fullgraph=True)`` cannot
    trace) stay outside it. Levers applied afterwards are refused."""
    current = module.__dict__.get("forward")
    if isinstance(current, _LeverForward):
        current.inner = compile_fn(current.inner)
    else:
        module.forward = compile_fn(module.forward)


class _Checkpointed(_LeverForward):
    """A decoder layer's forward under non-reentrant activation checkpointing; with
    ``"offload"`` its input hidden states (the first argument) are saved in host memory."""

    def __init__(self, inner, mode, offloader: HostOffloader | None):
        super().__init__(inner)
        self.offloader = offloader if mode == "offload" else None

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved: nothing to recompute
            return self.inner(*args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        held = self.offloader.hold(hidden) if self.offloader else contextlib.nullcontext()
        with held:  # keep only the layer's input; backward re-runs it (and its collectives)
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class _TiledMLP(_LeverForward):
    """A gated MLP's forward over tiles of ``tile`` local tokens (inputs of at most
    ``tile`` tokens run the plain MLP)."""

    def __init__(self, inner, tile: int):
        super().__init__(inner)
        self.tile = tile

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= self.tile:
            return self.inner(x)
        # the Linears' own weights, as their forward reads them (under FSDP2: the
        # unsharded parameters, set by the decoder layer's pre-forward hook), and their
        # LoRA adapters (usp.models.lora), which the tiled function computes per tile
        mlp = self.inner.__self__
        *weights, activation = _glu_weights(mlp)
        return tiled_glu(x, *weights, self.tile, _glu_adapters(mlp, x), activation)


_GLU = ("gate_proj", "up_proj", "down_proj")
#: a gated MLP with gate and up in one matrix, the gate's rows first (Granite's)
_FUSED_GLU = ("input_linear", "output_linear")


def _glu_linears(mlp: nn.Module) -> list:
    """The MLP's projections: (gate, up, down), or (gate and up, down) when fused."""
    fused = [getattr(mlp, name, None) for name in _FUSED_GLU]
    if all(isinstance(m, nn.Linear) for m in fused):
        return fused
    return [getattr(mlp, name, None) for name in _GLU]


def _glu_adapters(mlp: nn.Module, x: torch.Tensor) -> tuple:
    """The LoRA adapters of (gate, up, down) for this forward's ``x``: a fused
    projection's adapter is one ``a`` and ``b``'s two halves."""
    linears = _glu_linears(mlp)
    adapters = [low_rank(m, x) for m in linears]
    if len(linears) == 3:
        return tuple(adapters)
    fused, down = adapters
    if fused is None:
        return (None, None, down)
    gate_b, up_b = fused.b.chunk(2)  # [2 I, rank] -> [I, rank] each
    return (fused.with_factors(fused.a, gate_b), fused.with_factors(fused.a, up_b), down)


def _mlp_of(layer: nn.Module, index: int) -> nn.Module:
    """A decoder layer's MLP (``layer.mlp``), or a LeverError naming the layer."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise LeverError(
            f"mlp_tile_tokens needs each decoder layer's MLP as .mlp; layer {index} "
            f"({type(layer).__name__}) has none: use mlp_tile_tokens = 0"
        )
    return mlp


def _glu_weights(mlp: nn.Module):
    """(gate, up, down weights, activation name) of a bias-free gated MLP (a fused one's
    gate and up: two views of its matrix) whose activation the tiles compute (SiLU;
    tanh-GELU as usp's MLP holds it), or a LeverError."""
    linears = _glu_linears(mlp)
    activation = _activation(getattr(mlp, "act_fn", nn.SiLU()))
    if not all(isinstance(m, nn.Linear) and m.bias is None for m in linears) or not activation:
        raise LeverError(
            f"mlp_tile_tokens needs a SwiGLU MLP (gate_proj, up_proj, down_proj without bias, "
            f"SiLU; or input_linear and output_linear, Granite's), usp's GeGLU or usp's "
            f"experts; {type(mlp).__name__} is not one: use mlp_tile_tokens = 0"
        )
    if len(linears) == 2:  # [2 I, dim] -> gate, up [I, dim]
        return (*linears[0].weight.chunk(2), linears[1].weight, activation)
    return linears[0].weight, linears[1].weight, linears[2].weight, activation


def _activation(act) -> str | None:
    """The tiles' name of a gated MLP's activation module: torch's SiLU or transformers'
    (``ACT2FN["silu"]``: a module computing ``F.silu``, named apart from torch's), torch's
    tanh-approximated GELU (usp's GeGLU); None for any other."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_pytorch_tanh"
    cls = type(act)
    if cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers."):
        return "silu"
    return None

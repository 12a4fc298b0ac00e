"""Setting an HF causal LM up for usp's sequence parallelism, from outside the model.

:func:`launch_plan` is the :class:`usp.Plan` of the running launch (torchrun's processes,
or one process); :func:`prepare_model` registers USP attention for it, refuses what the
plug-in cannot compute exactly (:func:`feature_problems`), applies the memory levers
(:class:`usp.models.Levers`: the object ``usp train`` and ``usp plan`` use), gives the
model the chunked loss forward (:func:`usp.models.hf.add_loss_forward`) and shards it with
FSDP2 over the ``dp x sp`` mesh with gradients summed, not averaged
(:func:`usp.train.parallelize.fully_shard_model`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import usp.models.hf as usp_hf
from usp.errors import ModelConfigError, TopologyError
from usp.linear import GatedDeltaNet, KimiDeltaAttention, Mamba1Mixer, Mamba2Mixer, ShortConv
from usp.models import Levers, decoder_layers
from usp.models.hf_mixers import mixer_problem
from usp.process_groups import build_topology
from usp.sp.plan import Plan
from usp.train.parallelize import fully_shard_model


class UnsupportedModelError(ModelConfigError):
    """An HF model feature USP attention cannot compute exactly (the message names it)."""


def launch_plan(
    ulysses: int = 1,
    ring: int = 1,
    *,
    topology_file: str | os.PathLike | None = None,
    **attention_options,
) -> Plan:
    """The plan of the running launch: ``ulysses x ring`` SP ranks per data-parallel
    replica, the rest of the world data-parallel (or the degrees and choices of
    ``topology_file``, a usp topology config). Initialises ``torch.distributed`` from
    torchrun's environment when it is not yet (NCCL with CUDA, else gloo); one process
    (no ``WORLD_SIZE``) is ``Plan(None)``. ``attention_options``: ``layout``,
    ``ring_impl``, ``backend``, and the Gated DeltaNet layers' kernels
    ``linear_backend`` / ``linear_conv_backend`` (:class:`usp.Plan`'s). Collective under
    torchrun: every rank calls it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if topology_file is None and ulysses * ring > 1:
            raise TopologyError(
                f"ulysses({ulysses}) * ring({ring}) = {ulysses * ring} SP ranks need as many "
                f"processes: launch with torchrun --nproc-per-node {ulysses * ring} (this is "
                "one process), or run this one without SP: ulysses = ring = 1 (the examples' "
                "--ulysses 1 --ring 1)"
            )
        if topology_file is None:
            return Plan(None, **attention_options)
    if topology_file is not None:
        return Plan.from_config(topology_file, **attention_options)
    return Plan(build_topology(ulysses, ring), **attention_options)


# ----------------------------------------------------------------------------- features
def attention_chunk(config) -> int | None:
    """The attention chunk (Llama 4's ``attention_chunk_size``) any of the model's layers
    applies, as transformers reads its config; None: no chunked layer. (Causal sliding
    windows are not here: the attention call gets ``sliding_window`` and USP attention
    computes it exactly.)"""
    types = getattr(config, "layer_types", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and (types is None or "chunked_attention" in types):
        return int(chunk)
    return None


def feature_problems(
    model: nn.Module, levers: Levers, plan: Plan | None = None, *, device=None
) -> list[str]:
    """What in ``model`` (its config and attention modules) USP attention or the chosen
    levers cannot compute exactly; empty when everything can. Under ``plan``'s sequence
    parallelism also any module that mixes tokens outside attention (Mamba, linear
    attention, convolutions: :mod:`usp.models.hf_mixers`), and a Gated DeltaNet kernel
    the plan forces that cannot run usp's layers on ``device`` (:func:`kernel_problem`).
    Deterministic from the model, so every rank finds the same."""
    config = model.config
    problems = []
    mixers = None if plan is None else mixer_problem(model, plan)
    if mixers is not None:
        problems.append(mixers)
    kernels = None if plan is None else kernel_problem(model, plan, device)
    if kernels is not None:
        problems.append(kernels)
    if getattr(config, "is_encoder_decoder", False):
        problems.append("an encoder-decoder model (usp serves decoder-only causal LMs)")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        problems.append(
            f"attention logit soft-capping (config.attn_logit_softcapping={softcap}): USP "
            "attention computes plain softmax attention"
        )
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        problems.append(
            f"attention dropout (config.attention_dropout={dropout}): set it to 0.0 "
            "(USP attention has no dropout)"
        )
    try:
        decoder_layers(model)  # what the levers act on
    except ModelConfigError as err:
        problems.append(str(err))
    if levers.loss_chunk_tokens is not None:
        try:
            usp_hf.check_chunked_loss(model)
        except ValueError as err:
            problems.append(str(err))
    return problems


#: usp's mixer layers whose kernels a plan may force, as the set-up check names them
_KERNEL_LAYERS = (
    (GatedDeltaNet, "Gated DeltaNet"), (Mamba2Mixer, "Mamba-2"), (KimiDeltaAttention, "KDA"),
    (ShortConv, "short conv"), (Mamba1Mixer, "Mamba-1"),
)  # fmt: skip


def kernel_problem(model: nn.Module, plan: Plan, device=None) -> str | None:
    """Why a kernel ``plan`` forces (``linear_backend`` / ``linear_conv_backend``) cannot
    run the model's linear mixer layers (usp's, once swapped in: Gated DeltaNet, Mamba-2,
    KDA, the short conv, Mamba-1) on ``device`` (default: their parameters') in their
    parameters' dtype (each layer's ``kernel_refusal``: the kernels' limits, no kernel
    run), or None."""
    for module in model.modules():
        for cls, name in _KERNEL_LAYERS:
            if isinstance(module, cls):
                refusal = module.kernel_refusal(plan, device=device)
                if refusal is not None:
                    return f"its {name} layers: {refusal}"
    return None


def window_problem(config, seq_len: int) -> str | None:
    """Why a global sequence of ``seq_len`` tokens cannot be attended exactly by
    ``config``'s layers (an attention chunk shorter than it), or None. Sliding windows
    and attention sinks are computed exactly by USP attention."""
    chunk = attention_chunk(config)
    if chunk is None or chunk >= seq_len:
        return None
    return (
        f"a global sequence (or packed row) of {seq_len} tokens for a model whose layers "
        f"attend within chunks of {chunk} tokens (config.attention_chunk_size): USP "
        "attention computes causal attention (with sliding windows), not chunked attention, "
        f"exact for such layers only on sequences of at most {chunk} tokens; shorten the "
        "sequences (max_length) or train this model without usp"
    )


# ----------------------------------------------------------------------------- the model
def compute_device(model: nn.Module, plan: Plan, *, use_cpu: bool = False) -> torch.device:
    """Where ``model`` computes once prepared and handed to a Trainer: under several
    processes the plan's device (FSDP2 moves the parameters there); in one process CUDA
    when it is available and ``use_cpu`` (``TrainingArguments.use_cpu``) is not set (the
    Trainer moves the model there), else the parameters' device."""
    if plan.topology.world_size > 1:
        return plan.default_device()
    if torch.cuda.is_available() and not use_cpu:
        return torch.device("cuda", torch.cuda.current_device())
    return next(model.parameters()).device


@dataclass(frozen=True)
class PreparedModel:
    """What :func:`prepare_model` did: the attention name registered, the levers, and
    the factor the loss is multiplied by before ``backward`` (1 when FSDP2 sums the
    gradients itself)."""

    attention: str
    levers: Levers
    sharded: bool
    loss_scale: float = 1.0
    #: transformers' Gated DeltaNet layers replaced by usp's (Qwen3.5, Qwen3-Next)
    linear_attention_layers: int = 0


def prepare_model(
    model: nn.Module,
    plan: Plan,
    levers: Levers | None = None,
    *,
    name: str = "usp",
    use_cpu: bool = False,
) -> PreparedModel:
    """Make ``model`` (an HF causal LM) ready to train on ``plan``, in place: USP
    attention registered under ``name`` and switched on, the ``levers`` applied, the loss
    forward added (when the loss is chunked), and under a multi-process plan every
    decoder layer and the root sharded with FSDP2 over ``dp x sp`` with summed gradients
    (the SP ranks' gradients are parts of one gradient). A feature USP attention cannot
    compute exactly is an :class:`UnsupportedModelError` (the same on every rank: it
    comes from the model). Apply before handing the model to a Trainer.

    transformers' Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) are replaced by
    usp's (:func:`usp.models.hf.swap_linear_attention`: the same parameters and names),
    which compute them exactly under the plan's SP and restart them at every document of
    a padding-free batch; in one process too, so that one process and N ranks run the
    same layers. Their kernels are the plan's choice (``linear_backend`` /
    ``linear_conv_backend``); a forced one that cannot run where the model will compute
    (:func:`compute_device`; ``use_cpu``: the Trainer's) is an
    :class:`UnsupportedModelError` here."""
    levers = Levers() if levers is None else levers
    if not isinstance(levers, Levers):
        raise TypeError(f"levers must be a usp.models.Levers, got {type(levers).__name__}")
    swapped = usp_hf.swap_linear_attention(model, plan)  # before FSDP2 and the optimizer
    device = compute_device(model, plan, use_cpu=use_cpu)
    problems = feature_problems(model, levers, plan, device=device)
    if problems:
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be trained exactly under usp: " + "; ".join(problems)
        )
    name = usp_hf.register(plan, name=name, model=model)  # inspected here, not on meta
    model.set_attn_implementation(name)
    model.config.use_cache = False  # a KV cache has no place in SP training
    levers.apply(model, plan)
    if levers.loss_chunk_tokens is not None:
        usp_hf.add_loss_forward(model)
    sharded, scale = False, 1.0
    if plan.topology.world_size > 1:
        scale = fully_shard_model(model, plan.topology, levers=levers).loss_scale
        sharded = True
        # transformers' Trainer then neither wraps the model in DDP nor shards it again
        # (its path for models sharded at load time: usp owns placement and reduction),
        # and defers the reduce-scatter to a step's last micro-batch
        model._is_distributed_loading_by_transformers = True
        model._is_fsdp_managed_module = True
    return PreparedModel(name, levers, sharded, scale, swapped)

"""FSDP2 over the topology's ``dp x sp`` mesh, applied to a model from outside.

Every decoder layer and then the root module are ``fully_shard``-ed over
``topology.dp_sp_mesh``: parameters are sharded over all ``dp * sp`` ranks of the world,
gathered layer by layer for compute. The SP ranks of a replica see different tokens of
the same sequences, so their gradients are parts of one gradient and must be SUMMED;
the dp replicas see different sequences. The trainer normalises every micro-batch loss
by the label count of the whole optimizer step (all replicas), so the exact gradient of
the step's mean loss is the plain sum over the whole mesh. FSDP2 averages over the mesh
by default; :func:`fully_shard_model` switches it to a sum: a divide factor of 1
(``set_gradient_divide_factor``) carried out as a SUM reduction with a post-scale
(``set_force_sum_reduction_for_comms``; the factor alone would need ``PREMUL_SUM``, which
gloo lacks). On a torch without those calls it returns the factor to scale the loss by.

Parameter offload (``Levers.offload_parameters``, ``[train] offload_parameters``): every
``fully_shard`` gets FSDP2's ``CPUOffloadPolicy``: the sharded float32 parameters and
their gradients stay in host memory (pinned on CUDA), each all-gather copies a shard to
the device first and each reduce-scatter's output goes back to the host, so AdamW steps
on the host (its state is created where the parameters are). On a CPU mesh host and
device are one memory: the same code path runs, nothing moves.

:func:`compile_layers` (``[train] compile = true``) compiles each decoder layer's forward
(``fullgraph=True``: attention's collectives inside the graph), as torchtitan compiles
per block, before the layers are sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from usp.comm.overlap import compile_options
from usp.models.family import decoder_layers
from usp.models.levers import Levers, compile_forward


@dataclass(frozen=True)
class ShardedModel:
    module: nn.Module
    #: multiply the loss by this before ``backward`` (1 when FSDP sums gradients itself)
    loss_scale: float


def mixed_precision(compute_dtype: torch.dtype, param_dtype: torch.dtype):
    """bf16 (or other) compute with float32 gradient reduction; None when compute runs in
    the parameters' dtype (fp32 on CPU)."""
    if compute_dtype == param_dtype:
        return None
    # no cast of forward inputs: the models' float inputs are made inside them in the
    # compute dtype (embeddings, RoPE tables), and FSDP's cast rebuilds every dataclass
    # argument with dataclasses.replace, which a PackedSequence (init=False fields) refuses
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def fully_shard_model(
    model: nn.Module, topology, *, levers: Levers, compute_dtype: torch.dtype | None = None
) -> ShardedModel:
    """Shard ``model`` (a usp model of any family, or an HF causal LM: its decoder layers
    from :func:`usp.models.decoder_layers`) over ``topology.dp_sp_mesh``.

    ``compute_dtype``: None or the parameters' dtype runs in that dtype; another (bf16)
    adds a :class:`MixedPrecisionPolicy` with float32 reduction. Parameters on the CPU are
    moved to the mesh's device by ``fully_shard``, unless ``levers`` (the
    :class:`usp.models.Levers` the model was built with) say ``offload_parameters``: then
    they stay on the host (:func:`offload_policy`). Frozen parameters (``requires_grad`` False: LoRA's
    base weights) are cast to ``compute_dtype`` first: they are never updated, so they
    need no float32 master copy (FSDP2 gathers them as they are); the trainable ones keep
    their dtype (the master weights).
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    param_dtype = (trainable or params)[0].dtype
    if compute_dtype is not None:
        with torch.no_grad():
            for p in params:
                if not p.requires_grad and p.is_floating_point() and p.dtype != compute_dtype:
                    p.data = p.data.to(compute_dtype)  # in place: tied weights stay tied
    options = {"mesh": topology.dp_sp_mesh}
    policy = mixed_precision(compute_dtype or param_dtype, param_dtype)
    if policy is not None:
        options["mp_policy"] = policy
    if levers.offload_parameters:
        options["offload_policy"] = offload_policy(topology.dp_sp_mesh.device_type)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again right away in backward: keep them
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **options)
    fully_shard(model, **options)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if all(hasattr(m, "set_force_sum_reduction_for_comms") for m in fsdp_modules):
        for m in fsdp_modules:
            # divide by 1 (a sum), done as a plain SUM reduce-scatter with a post-scale of
            # 1: without the second call the divide factor would need PREMUL_SUM
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        return ShardedModel(model, 1.0)
    return ShardedModel(model, float(topology.dp_sp_mesh.size()))  # undo FSDP's mean


def offload_policy(device_type: str):
    """FSDP2's ``CPUOffloadPolicy`` for a mesh on ``device_type``: pinned host memory on
    CUDA (the copies overlap compute; torch's pinned allocator rounds each block up to
    a power of two, which ``usp plan`` counts), pageable elsewhere (pinning needs CUDA)."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def parameters_device(levers: Levers, device: torch.device) -> torch.device:
    """Where a sharded model's parameters are materialised (``to_empty``, a checkpoint's
    weights): the host with ``levers.offload_parameters``, else ``device``."""
    return torch.device("cpu") if levers.offload_parameters else device


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on all but the last micro-batch of a step (the
    unsharded gradients accumulate locally; no effect on a model without FSDP)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def compile_layers(
    model: nn.Module, *, fullgraph: bool = True, backend: str = "inductor", **compile_kwargs
) -> int:
    """``torch.compile`` each decoder layer of ``model`` (:func:`usp.models.decoder_layers`) in
    place, as torchtitan compiles per block; returns how many. Only the layer's own
    ``forward`` is compiled (inside the memory levers' wrappers, which stay eager: the
    checkpoint recomputes the compiled graph, the offload's host copies are made outside
    it), so parameter names, checkpoints and the hooks around a layer (FSDP's gathers)
    stay as they are. Apply after the levers, before or after :func:`fully_shard_model`.

    ``fullgraph=True`` (the default, and what ``[train] compile = true`` uses): each
    layer's forward and backward are one graph each, sequence-parallel attention
    included (its collectives are functional collectives of the graph, its checks run
    while tracing; see docs/architecture.md, *torch.compile*); a graph break is an error rather than a
    slow path. The layers share their graphs (one per call shape). With Inductor (and
    no ``mode``) its ``options`` start from :func:`usp.compile_options` (communication
    kept overlapped with compute); ``compile_kwargs`` go to ``torch.compile``
    (``mode``, ``options``, ``dynamic``, ...)."""
    if backend == "inductor" and "mode" not in compile_kwargs:
        compile_kwargs["options"] = {**compile_options(), **compile_kwargs.get("options", {})}
    layers = decoder_layers(model)
    for layer in layers:  # inside the levers' wrappers: checkpointing recomputes the graph
        compile_forward(
            layer,
            lambda f: torch.compile(f, fullgraph=fullgraph, backend=backend, **compile_kwargs),
        )
    return len(layers)

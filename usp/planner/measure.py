"""One rank's real training step, measured under fake tensors: memory without the memory.

:func:`measure` builds what ``usp train`` builds for one rank of a world of any size --
the topology's ``dp x ring x ulysses`` mesh on PyTorch's ``fake`` process group, the
model from the config (:func:`usp.train.components.build_model`, with the config's
activation checkpointing and memory levers), FSDP2 over ``dp x sp``
(:func:`usp.train.parallelize.fully_shard_model`, bf16 compute and fp32 master weights
for CUDA), AdamW (:func:`usp.train.components.build_optimizer`) -- and runs two optimizer
steps of the trainer's arithmetic (pack, shard, forward with the chunked SP loss,
backward, gradient clipping, AdamW; micro-batches with the gradient sync of the last one
only) under ``FakeTensorMode`` with torch's ``FSDPMemTracker`` counting every allocation
and free (:class:`usp.planner.tracker.PlanningTracker`, the same counts with less
bookkeeping). The second step runs with the optimizer state the first one created. Nothing
is computed: every op only allocates its outputs.

Token loops: the step's memory-periodic loops over tiles of tokens (RMSNorm's, the
loss's, the tiled MLP's: :mod:`usp.models.tiling`) run their first and last tile only
(``representative``, the default): under fake tensors every op costs the same host time
whatever its size, so those loops made a step's cost grow with the tokens per rank,
while their memory peak is reached in those two tiles.
``tests/planner/test_planner_speed.py`` checks the footprints against full loops byte
for byte.

Depth: ``layers`` decoder layers are built (default: the model's). Each phase's peak
(every forward, every backward, the optimizer) is affine in the depth once the depth is
at least the first of :data:`usp.planner.footprint.SCALING_DEPTHS` (every layer adds its parameter, gradient and
optimizer shards and its saved activations, and the peak stays in the same place), so
:func:`measure_scaled` measures two small depths and extrapolates each phase, which
``tests/planner/test_planner.py`` checks byte for byte against a full-depth run.

Device: ``"cuda"`` is a CUDA run (bf16 compute, cuDNN's attention ops); ``"cpu"`` one on
the CPU (fp32, the CPU flash kernel's ops). Autograd cannot run on ``cuda`` fake tensors
in a torch built without CUDA, so there the CUDA step runs on CPU fake tensors with CUDA's
dtypes and cuDNN's op schemas (the same tensors; the caching allocator's 512-byte
rounding is ignored). On a CUDA build it runs on ``cuda`` fake tensors, and tensors the
step keeps on the host (offloaded activations) are counted as host memory. On the CPU
stand-in, the host copies of ``activation_checkpointing = "offload"``
(:class:`usp.models.offload.HostOffloader`) go to the ``meta`` device instead, which the
tracker counts apart: they are the step's host memory
(:data:`usp.planner.footprint.HOST_STAND_IN`), and the device peak is what stays on the
device. What a step gives (:class:`usp.planner.footprint.Footprint`) and the depth line
are in :mod:`usp.planner.footprint`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

import usp
from usp.models import shard_batch
from usp.models.offload import HostOffloader, pinned_bytes, pinned_waste
from usp.models.tiling import representative_tiles
from usp.planner.footprint import (
    HOST_STAND_IN,
    OFFLOADED_PARAMETER_CATEGORIES,
    Choice,
    Extras,
    Footprint,
    Target,
    footprint_of,
    from_runs,
    scaling_runs,
)
from usp.planner.kernels import KernelLog, planning_backend, planning_kernels
from usp.planner.tracker import PlanningTracker, phase_peak
from usp.process_groups.fake import fake_world
from usp.train import components
from usp.train.parallelize import fully_shard_model
from usp.train.step import StepOutcome, TrainStep, clip_gradients

#: micro-batches run per step at most: the second holds what accumulation holds
MAX_MICRO_BATCHES = 2


def measure_scaled(target: Target, choice: Choice) -> Footprint:
    """:func:`measure` at the model's full depth, from two shallow runs (see
    :func:`scale_depth`); models no deeper than the second depth run in full."""
    runs = [measure(target, choice, layers=d) for d in scaling_runs(target.model)]
    return from_runs(target.model, runs)


def stand_in_device(device: str) -> torch.device:
    """The device the fake tensors live on (see the module docstring)."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure(
    target: Target,
    choice: Choice,
    *,
    layers: int | tuple[str, ...] | None = None,
    tracker: type | None = None,
    representative: bool = True,
) -> Footprint:
    """One rank's (rank 0's: every rank holds the same shares) peak memory per phase of
    a step, under fake tensors; ``layers`` decoder layers (default: the model's).
    ``tracker``: the memory tracker's class (default
    :class:`usp.planner.tracker.PlanningTracker`; torch's ``FSDPMemTracker`` gives the
    same footprint, slower). ``representative``: memory-periodic token loops run their
    first and last tile only (:mod:`usp.models.tiling`; the same footprint, faster)."""
    step = built_step(target, choice, layers=layers, fake=True, representative=representative)
    with step as built:
        phases = _tracked_steps(built, tracker)
        extras = measure_extras(target, choice, built)
    stand_in = _host_stand_in(target, built.device)
    moved = OFFLOADED_PARAMETER_CATEGORIES if stand_in and choice.levers.offload_parameters else ()
    return footprint_of(
        phases, built.device, built.layers, target.device, host_categories=moved, extras=extras
    )


def measure_extras(target: Target, choice: Choice, built: BuiltStep) -> Extras:
    """What the step shows besides its tracked tensors (:class:`Extras`): the largest
    kernel workspace, the pinned allocator's rounding of the blocks a CUDA run pins
    (offloaded layer inputs: one block per layer; FSDP's offloaded parameter and
    gradient shards: one each per parameter), and the parameter offload's device copies
    a CPU stand-in does not make."""
    log = built.kernels or KernelLog()
    pinned = copies = 0
    levers = choice.levers
    if target.device == "cuda":
        if levers.activation_checkpointing == "offload":
            pinned += offload_rounding(target, choice, target.seq_len, built.layers)
        if levers.offload_parameters:
            units = _fsdp_units(built.model)
            shards = [4 * n for unit in units for n in unit]  # float32 shards, bytes
            pinned += 2 * sum(pinned_bytes(b) - b for b in shards)  # parameter + gradient
            if _host_stand_in(target, built.device):
                copies = max(shards) + 4 * max(sum(unit) for unit in units)
    return Extras(log.workspace, log.call, pinned, copies)


def offload_rounding(target: Target, choice: Choice, seq_len: int, layers: int) -> int:
    """What the pinned allocator adds to a CUDA step's offloaded layer inputs at
    ``seq_len`` (``activation_checkpointing = "offload"``: one copy per layer of a
    micro-batch's local tokens x hidden in the compute dtype, held in the pieces of
    :func:`usp.models.offload.pinned_pieces`, each rounded up to a power of two; 0 for
    other levers or devices). A step function of the length: the longest-sequence search
    adds it exactly to its line (:mod:`usp.planner.search`)."""
    if target.device != "cuda" or choice.levers.activation_checkpointing != "offload":
        return 0
    tokens = seq_len * target.job.train.micro_batch // choice.sp
    item = components.compute_dtype(target.job, torch.device("cuda")).itemsize
    return layers * pinned_waste(tokens * target.model.hidden_size, item)


def _fsdp_units(model) -> list[list[int]]:
    """Each FSDP module's parameter shards on this rank, as element counts (padded)."""
    units = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            units.append([p._sharded_param_data.numel() for p in group.fsdp_params])
    return units


@dataclass(frozen=True)
class BuiltStep:
    """One rank's training step as ``usp train`` builds it (:func:`built_step`)."""

    step: object  # usp.train.step.TrainStep (its model and optimizer)
    batches: list  # the micro-batches run (usp.models.ShardedBatch each; at most 2)
    num_labels: int  # the step's label count (every micro-batch's labels)
    device: torch.device
    layers: int
    compute_dtype: torch.dtype = torch.float32
    kernels: KernelLog | None = None  # the planning kernels' workspaces (fake runs)

    @property
    def model(self):
        return self.step.model

    @property
    def optimizer(self):
        return self.step.optimizer

    def phases(self) -> Iterator[str]:
        """Run the step (the trainer's :meth:`usp.train.step.TrainStep.phases`, the update
        always applied); yields each phase's name as it ends."""
        outcome = StepOutcome(torch.zeros((), dtype=torch.float64, device=self.device))
        yield from self.step.phases(self.batches, self.num_labels, outcome)


@contextmanager
def built_step(
    target: Target,
    choice: Choice,
    *,
    layers: int | tuple[str, ...] | None = None,
    fake: bool = True,
    representative: bool = True,
):
    """Everything one rank of ``usp train`` builds for this layout, on the ``fake``
    process group: yields a :class:`BuiltStep` whose ``step`` is the trainer's own
    :class:`usp.train.step.TrainStep`. ``representative`` (fake only): inside
    :func:`usp.models.tiling.representative_tiles`. ``fake=False`` builds real tensors
    (a small step run for real, to check the planner against); on the CPU the planning
    kernels serve attention either way (the same aten ops; the real backend would read
    the uninitialised data the fake process group delivers), on CUDA a real run uses
    the real backends."""
    job = target.job
    config = target.model
    if isinstance(layers, tuple):  # the first layers of a model with several kinds
        config = config.replace(num_hidden_layers=len(layers), layer_types=layers)
    elif layers is not None:
        config = config.replace(num_hidden_layers=layers)
    device = stand_in_device(target.device)
    parallel = job.topology.parallel
    with fake_world(target.world_size, 0, device):
        topo = usp.build_topology(
            choice.ulysses,
            choice.ring,
            dp_degree=choice.dp,
            ranks_per_node=target.ranks_per_node,
            device_type=device.type,
            placement=parallel.placement,
            allow_cross_node_ulysses=parallel.allow_cross_node_ulysses,
        )
        try:
            attention = job.topology.attention
            registry = kernels = None
            if fake or device.type == "cpu":  # (a real CUDA run uses the real kernels)
                registry, kernels = planning_kernels()
            plan = usp.Plan(
                topo,
                layout=attention.layout,
                ring_impl=attention.ring_impl,
                backend=planning_backend(target.device, attention.backend),
                verify_calls=False,
                kernel_registry=registry,
            )
            with ExitStack() as stack:
                if fake:
                    if representative:
                        stack.enter_context(representative_tiles())
                    stack.enter_context(AllLabelledFakeMode(allow_non_fake_inputs=True))
                # the packed row as fake tensors: nothing proportional to the sequence is
                # made on the planning machine (the boundaries stay real host values)
                batches, num_labels = _batches(job, plan, device, choice)
                source = components.ModelSource(config, None)
                # the activation offload's host copies: on the host stand-in when a CUDA
                # step runs on the CPU stand-in (a no-op without activation offload)
                offloader = HostOffloader()
                if fake and _host_stand_in(target, device):
                    offloader.host_device = HOST_STAND_IN
                model = components.build_model(
                    job, source, plan, choice.levers, offloader=offloader
                )
                dtype = components.compute_dtype(job, torch.device(target.device))
                sharded = fully_shard_model(model, topo, levers=choice.levers, compute_dtype=dtype)
                if not fake:
                    _randomise(sharded.module)
                optimizer = components.build_optimizer(job, sharded.module, choice.levers)
                if fake and _host_stand_in(target, device):
                    _optimizer_to(optimizer, HOST_STAND_IN)
                    _as_on_cuda(optimizer)
                _first_optimizer_step(sharded.module, optimizer)
                step = TrainStep(
                    sharded.module,
                    optimizer,
                    loss_scale=sharded.loss_scale,
                    grad_clip=job.train.grad_clip,
                    clip=_clip_local_shards if fake else clip_gradients,
                )
                yield BuiltStep(
                    step, batches, num_labels, device, config.num_hidden_layers, dtype, kernels
                )
        finally:
            topo.destroy()


def _host_stand_in(target: Target, device: torch.device) -> bool:
    """Whether host memory needs a stand-in: a CUDA step run on the CPU stand-in."""
    return target.device == "cuda" and device.type == "cpu"


def _optimizer_to(optimizer, host: torch.device) -> None:
    """Keep a host optimizer's state and copies on ``host`` (a no-op for an on-device
    optimizer, and for one that updates parameters already on the host in place)."""
    if hasattr(optimizer, "host_device") and not getattr(optimizer, "params_on_host", False):
        optimizer.host_device = host


def _as_on_cuda(optimizer) -> None:
    """Run a device optimizer as it runs on CUDA: ``torch.optim.AdamW`` picks its
    ``foreach`` implementation there by default (every parameter a DTensor or a tensor on
    ``cuda``; ``torch.optim.optimizer._default_to_fused_or_foreach``), but the
    single-tensor one on the CPU stand-in. The foreach update holds a float32 temporary
    the size of every local shard at once (``_foreach_sqrt`` of the second moments), the
    single-tensor one that of one parameter: planned single-tensor, a CUDA step's
    optimizer phase would be under-counted. (Also far fewer ops under fake tensors: one
    per update term instead of one per parameter and term.) ``HostAdamW`` keeps its own
    choice (``foreach=False``, on the host)."""
    if type(optimizer) is not torch.optim.AdamW:
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is None:
            group["foreach"] = True


def _randomise(model) -> None:
    """Finite values for the shards a real run computes with (``to_empty`` left them
    uninitialised when the model came from the meta device)."""
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02)


def _batches(job, plan, device: torch.device, choice: Choice) -> tuple[list, int]:
    """The step's micro-batches for this rank, sharded as the trainer shards them
    (:func:`usp.models.shard_batch`): one document filling the packed row, every token
    labelled (the most the loss can hold); at most :data:`MAX_MICRO_BATCHES` (the second
    holds what accumulation holds). Returns them and the step's label count. Called
    inside the step's ``FakeTensorMode`` (when faked): the row and its shards are fake
    tensors, nothing of the sequence's size is allocated; only the document boundaries
    are packed for real (``Plan.pack`` reads them as host values: two int32 numbers)."""
    row = job.train.micro_batch * job.train.seq_len  # a forward's packed row
    micro_batches = min(job.gradient_accumulation(choice.dp), MAX_MICRO_BATCHES)
    with unset_fake_temporarily():
        cu_seqlens = torch.tensor([0, row], dtype=torch.int32)
        packed = plan.pack(cu_seqlens, device=device)  # (the SP ranks agree: fake group)
    tokens = torch.zeros(1, row, dtype=torch.long)  # [1, row]: fake inside the mode
    batch = shard_batch(
        plan, tokens, labels=tokens, cu_seqlens=packed, shift=False, device=device
    )  # ([1, row] -> [1, row / sp])
    return [batch] * micro_batches, row * micro_batches


def _tracked_steps(built: BuiltStep, tracker_class=None) -> list[dict]:
    """The step's peak snapshot per phase (forward, backward of each micro-batch; the
    optimizer), after a first optimizer step has created AdamW's state."""
    tracker = (tracker_class or PlanningTracker)(built.model, built.optimizer)
    phases = []
    with tracker:
        for phase in built.phases():
            phases.append(phase_peak(tracker))
            if phase.startswith("backward"):  # the next micro-batch's forward: a new pass
                tracker.reset_mod_stats()  # (per-module statistics only)
    return phases


def _clip_local_shards(model, max_norm: float) -> torch.Tensor:
    """Gradient-norm clipping as ``clip_grad_norm_`` does it on FSDP's DTensor gradients
    (a norm per local shard, one scalar all-reduce, every shard scaled in place), on the
    local shards. Under fake tensors ``clip_grad_norm_`` itself materialises whole
    gradients (a fake-mode artifact: for real it allocates a few hundred bytes, measured
    on CPU), which would count gigabytes that no real step holds."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in local])
    total = torch.linalg.vector_norm(norms)  # (all-reduced over the mesh in a real step)
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in local:
        g.mul_(coefficient.to(g.dtype))
    return total


def _first_optimizer_step(model, optimizer) -> None:
    """What a first step leaves behind: AdamW's state (two moments and a step count per
    trainable parameter: with LoRA the adapters'), no gradients. (The step's values do
    not matter, its tensors do.)"""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class AllLabelledFakeMode(FakeTensorMode):
    """The planned step's ``FakeTensorMode``, in which ``nonzero`` returns every index.

    ``nonzero`` has no size under fake tensors (it depends on values). The planned batch
    labels every token (the most the loss can hold), so the loss's selection of the
    labelled tokens would return every index; so does every other ``nonzero`` of the
    step (a MoE router's token selection per expert: each expert counted with every
    token, an upper bound)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            return _every_index(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _every_index(mask: torch.Tensor) -> torch.Tensor:
    """``nonzero(mask)`` of a mask that is true everywhere, as a fake tensor: int64
    [n, mask.dim()], column-major as torch's own (strides (1, n))."""
    n = mask.numel()
    return mask.new_empty_strided((n, mask.dim()), (1, n), dtype=torch.int64)

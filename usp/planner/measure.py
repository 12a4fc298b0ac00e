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
at least the first of :data:`SCALING_DEPTHS` (every layer adds its parameter, gradient and
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
tracker counts apart: they are the step's host memory (:data:`HOST_STAND_IN`), and the
device peak is what stays on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from usp.models.tiling import representative_tiles
from usp.planner.kernels import planning_backend, planning_kernels
from usp.process_groups.fake import fake_world

#: the memory tracker's categories -> the planner's breakdown
CATEGORIES = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters_gathered",
    "Buffer": "buffers",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients_unsharded",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "comm_all_gather",
    "Reduce Scatter": "comm_reduce_scatter",
    "Inputs": "inputs",
}
#: where a CUDA step planned on CPU fake tensors keeps its host copies (see above)
HOST_STAND_IN = torch.device("meta")
#: micro-batches run per step at most: the second holds what accumulation holds
MAX_MICRO_BATCHES = 2


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the grid and the activation-memory options."""

    ulysses: int
    ring: int
    dp: int
    activation_checkpointing: bool | str = False
    mlp_tile_tokens: int = 0

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring


@dataclass(frozen=True)
class Target:
    """What is planned: a parsed training config (its [train], [attention] and
    [parallel] placement), the full model, the cluster shape and the device type."""

    job: object  # usp.train.config.TrainJobConfig
    model: object  # usp.models.LlamaConfig, full depth
    world_size: int
    ranks_per_node: int
    device: str  # "cuda" or "cpu"

    @property
    def seq_len(self) -> int:
        return self.job.train.seq_len

    def at(self, seq_len: int) -> Target:
        """The same target at another sequence length."""
        return replace(self, job=self.job.with_overrides(seq_len=seq_len))


@dataclass(frozen=True)
class Phase:
    """The peak of one phase of a step (a forward, a backward, the optimizer), in bytes.
    ``breakdown`` splits the device peak by what the bytes held at that moment."""

    device: int
    host: int
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Footprint:
    """One rank's memory in a step: the peak of each phase, in step order."""

    phases: tuple[Phase, ...]
    layers: int
    #: False when host and device are one memory (a CPU run: everything is device
    #: memory, an offload's copies included). A CUDA step planned on the CPU stand-in
    #: counts the offload's host copies apart (on :data:`HOST_STAND_IN`)
    host_separated: bool = True

    @property
    def peak(self) -> Phase:
        """The phase with the highest device peak."""
        return max(self.phases, key=lambda p: p.device)

    @property
    def peak_device(self) -> int:
        return self.peak.device

    @property
    def peak_host(self) -> int:
        return max(p.host for p in self.phases)

    @property
    def breakdown(self) -> dict[str, int]:
        return self.peak.breakdown


def scale_depth(low: Footprint, high: Footprint, layers: int) -> Footprint:
    """Extrapolate two depths' footprints to ``layers``: every phase's peak (and each
    part of its breakdown) is affine in the depth, so it continues the line through the
    two; the step's peak is then the highest phase at that depth."""
    if len(low.phases) != len(high.phases) or high.layers <= low.layers:
        raise ValueError("scale_depth needs two footprints of the same step at two depths")
    steps = high.layers - low.layers

    def line(a: int, b: int) -> int:
        return a + (b - a) * (layers - low.layers) // steps

    phases = tuple(
        Phase(
            line(a.device, b.device),
            line(a.host, b.host),
            {k: line(a.breakdown.get(k, 0), v) for k, v in b.breakdown.items()},
        )
        for a, b in zip(low.phases, high.phases)
    )
    return Footprint(phases, layers, host_separated=high.host_separated)


#: the depths measured to extrapolate a deeper model from. From 3 layers on, the backward
#: peak sits in the second layer's backward (the first and the last layer are special:
#: the embedding's gradient, the last layer's parameters kept gathered), so 3 and 4 are
#: the shallowest depths on the backward's line (checked against 6 layers in the tests).
#: Known limit: a forward's peak can still move between 3 and 4 layers (seen for
#: Llama-3.1-70B on u8 x r8: 12.09, 12.24, then +0.38 GiB a layer), so a forward phase is
#: underestimated there; it stays below the backward's peak in every case measured
SCALING_DEPTHS = (3, 4)


def scaling_runs(model) -> tuple[int | None, ...]:
    """The depths :func:`measure_scaled` runs for ``model``: :data:`SCALING_DEPTHS`, or
    the full depth (``None``) for a model no deeper than the second."""
    return (None,) if model.num_hidden_layers <= SCALING_DEPTHS[1] else SCALING_DEPTHS


def from_runs(model, runs: list[Footprint]) -> Footprint:
    """The full-depth footprint from the runs of :func:`scaling_runs`, in that order."""
    if len(runs) == 1:
        return runs[0]
    low, high = runs
    return scale_depth(low, high, model.num_hidden_layers)


def measure_scaled(target: Target, layout: Layout) -> Footprint:
    """:func:`measure` at the model's full depth, from two shallow runs (see
    :func:`scale_depth`); models no deeper than the second depth run in full."""
    runs = [measure(target, layout, layers=d) for d in scaling_runs(target.model)]
    return from_runs(target.model, runs)


def stand_in_device(device: str) -> torch.device:
    """The device the fake tensors live on (see the module docstring)."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def job_for(target: Target, layout: Layout):
    """The target's config with this layout's grid and memory options, as ``usp train``
    would read them (so they are validated by the trainer's own config checks)."""
    options = {"activation_checkpointing": layout.activation_checkpointing}
    if layout.mlp_tile_tokens:
        options["mlp_tile_tokens"] = layout.mlp_tile_tokens
    return target.job.with_overrides(
        ulysses=layout.ulysses, ring=layout.ring, dp=layout.dp, **options
    )


def measure(
    target: Target,
    layout: Layout,
    *,
    layers: int | None = None,
    tracker: type | None = None,
    representative: bool = True,
) -> Footprint:
    """One rank's (rank 0's: every rank holds the same shares) peak memory per phase of
    a step, under fake tensors; ``layers`` decoder layers (default: the model's).
    ``tracker``: the memory tracker's class (default
    :class:`usp.planner.tracker.PlanningTracker`; torch's ``FSDPMemTracker`` gives the
    same footprint, slower). ``representative``: memory-periodic token loops run their
    first and last tile only (:mod:`usp.models.tiling`; the same footprint, faster)."""
    step = built_step(target, layout, layers=layers, fake=True, representative=representative)
    with step as (job, model, optimizer, batch):
        phases = _tracked_steps(job, model, optimizer, batch, tracker)
    return _footprint(phases, batch.device, model.config.num_hidden_layers, target.device)


@contextmanager
def built_step(
    target: Target,
    layout: Layout,
    *,
    layers: int | None = None,
    fake: bool = True,
    representative: bool = True,
):
    """Everything one rank of ``usp train`` builds for this layout, on the ``fake``
    process group: yields ``(job, model, optimizer, batch)`` for :func:`run_step`.
    ``representative`` (fake only): inside :func:`usp.models.tiling.representative_tiles`.
    ``fake=False`` builds real tensors (a small step run for real, to check the
    planner against); on the CPU the planning kernels serve attention either way (the
    same aten ops; the real backend would read the uninitialised data the fake process
    group delivers), on CUDA a real run uses the real backends."""
    import usp
    from usp.train import components
    from usp.train.parallelize import fully_shard_model

    job = job_for(target, layout)
    config = target.model
    if layers is not None:
        config = config.replace(num_hidden_layers=layers)
    device = stand_in_device(target.device)
    parallel = job.topology.parallel
    with fake_world(target.world_size, 0, device):
        topo = usp.build_topology(
            layout.ulysses,
            layout.ring,
            dp_degree=layout.dp,
            ranks_per_node=target.ranks_per_node,
            device_type=device.type,
            placement=parallel.placement,
            allow_cross_node_ulysses=parallel.allow_cross_node_ulysses,
        )
        try:
            attention = job.topology.attention
            plan = usp.Plan(
                topo,
                layout=attention.layout,
                ring_impl=attention.ring_impl,
                backend=planning_backend(target.device, attention.backend),
                verify_calls=False,
            )
            batch = _batch(job, plan, device, layout, fake)  # host-side packing: real tensors
            with ExitStack() as stack:
                if fake or device.type == "cpu":  # (a real CUDA run uses the real kernels)
                    stack.enter_context(planning_kernels())
                if fake:
                    stack.enter_context(all_labelled())
                    if representative:
                        stack.enter_context(representative_tiles())
                    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                model = components.build_model(job, components.ModelSource(config, None), plan)
                if fake and _host_stand_in(target, device):
                    _offload_to(model, HOST_STAND_IN)
                dtype = components.compute_dtype(job, torch.device(target.device))
                sharded = fully_shard_model(model, topo, compute_dtype=dtype)
                if not fake:
                    _randomise(sharded.module)
                optimizer = components.build_optimizer(job, sharded.module)
                _first_optimizer_step(sharded.module, optimizer)
                yield job, sharded.module, optimizer, batch
        finally:
            topo.destroy()


def _host_stand_in(target: Target, device: torch.device) -> bool:
    """Whether host memory needs a stand-in: a CUDA step run on the CPU stand-in."""
    return target.device == "cuda" and device.type == "cpu"


def _offload_to(model, host: torch.device) -> None:
    """Send the activation offload's host copies of every offloader in ``model`` to
    ``host`` (a no-op for a model without one)."""
    from usp.models.offload import HostOffloader

    for module in model.modules():
        offloader = getattr(module, "offloader", None)
        if isinstance(offloader, HostOffloader):
            offloader.host_device = host


def _randomise(model) -> None:
    """Finite values for the shards a real run computes with (``to_empty`` left them
    uninitialised when the model came from the meta device)."""
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02)


@dataclass(frozen=True)
class _Batch:
    """This rank's share of one micro-batch (one document filling the packed row) and
    how many micro-batches a step runs."""

    packed: object  # usp.PackedSequence
    input_ids: torch.Tensor  # [1, row / sp]
    labels: torch.Tensor  # [1, row / sp]
    position_ids: torch.Tensor  # [row / sp], what the model would compute from ``packed``
    num_labels: int
    micro_batches: int
    device: torch.device
    fake: bool  # measured under fake tensors (see :func:`_clip_local_shards`)


def _batch(job, plan, device: torch.device, layout: Layout, fake: bool) -> _Batch:
    """Packed and sharded as the trainer does (``plan.pack``, ``plan.shard``), outside
    fake mode: the boundaries are host values the layout reads."""
    row = job.train.micro_batch * job.train.seq_len  # a forward's packed row
    micro_batches = min(job.gradient_accumulation(layout.dp), MAX_MICRO_BATCHES)
    tokens = torch.zeros(1, row, dtype=torch.long)
    packed = plan.pack(torch.tensor([0, row], dtype=torch.int32), device=device)
    ids = plan.shard(tokens, packed=packed)  # [1, row] -> [1, row / sp]
    positions = plan.position_ids(row, packed=packed, device=device)
    labels = ids.clone()
    return _Batch(packed, ids, labels, positions, row * micro_batches, micro_batches, device, fake)


def _tracked_steps(job, model, optimizer, batch: _Batch, tracker_class=None) -> list[dict]:
    """The step's peak snapshot per phase (forward, backward of each micro-batch; the
    optimizer), after a first optimizer step has created AdamW's state."""
    from usp.planner.tracker import PlanningTracker, phase_peak

    tracker = (tracker_class or PlanningTracker)(model, optimizer)
    phases = []
    with tracker:
        for phase in run_step(model, optimizer, job, batch):
            phases.append(phase_peak(tracker))
            if phase.startswith("backward"):  # the next micro-batch's forward: a new pass
                tracker.reset_mod_stats()  # (per-module statistics only)
    return phases


def _clip_local_shards(model, max_norm: float) -> None:
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


def _first_optimizer_step(model, optimizer) -> None:
    """What a first step leaves behind: AdamW's state (two moments and a step count per
    parameter), no gradients. (The step's values do not matter, its tensors do.)"""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _phase_peak(tracker) -> dict:
    """:func:`usp.planner.tracker.phase_peak` (the name this module's callers import)."""
    from usp.planner.tracker import phase_peak

    return phase_peak(tracker)


def run_step(model, optimizer, job, batch: _Batch) -> Iterator[str]:
    """The arithmetic of ``usp.train.trainer._train_step`` without its host reads (the
    loss and the gradient norm as Python floats): micro-batch forward/backward with the
    gradient sync of the last only, clipping, AdamW, zeroed gradients. (FSDP sums the
    gradients itself on this torch, so the trainer's loss scale is 1.) Yields the name
    of each phase as it ends."""
    from usp.train.parallelize import set_gradient_sync

    for i in range(batch.micro_batches):
        input_ids, labels = batch.input_ids.to(batch.device), batch.labels.to(batch.device)
        set_gradient_sync(model, i == batch.micro_batches - 1)
        loss = model(
            input_ids,
            labels=labels,
            position_ids=batch.position_ids,
            cu_seqlens=batch.packed,
            num_items_in_batch=batch.num_labels,
        )
        yield f"forward {i}"
        loss.backward()
        del loss
        yield f"backward {i}"
    max_norm = job.train.grad_clip if job.train.grad_clip > 0 else float("inf")
    if batch.fake:
        _clip_local_shards(model, max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    yield "clip"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    yield "optimizer"


@contextmanager
def all_labelled() -> Iterator[None]:
    """``nonzero`` has no size under fake tensors (it depends on values): the loss's one
    use of it, selecting the labelled tokens, gets every index. The planned batch labels
    every token (the most the loss can hold), so that is what the op would return."""
    from torch._subclasses import fake_impls

    def every_index(fake_mode, func, mask):
        n = mask.numel()
        return mask.new_empty_strided((n, mask.dim()), (1, n), dtype=torch.int64)  # [n, dim]

    table = fake_impls.op_implementations_dict
    with mock.patch.dict(table, {torch.ops.aten.nonzero.default: every_index}):
        yield


def _footprint(phases: list[dict], device: torch.device, layers: int, planned: str) -> Footprint:
    return Footprint(
        tuple(_phase_footprint(snapshot, device) for snapshot in phases),
        layers,
        host_separated=planned != "cpu",
    )


def _phase_footprint(snapshot: dict, device: torch.device) -> Phase:
    peak_device, peak_host, breakdown = 0, 0, {}
    for dev, snap in snapshot.items():
        dev = torch.device(dev)
        total = int(snap.get("Total", 0))
        if dev.type == device.type:
            peak_device = total
            for key, value in snap.items():
                name = CATEGORIES.get(getattr(key, "value", key))
                if name is not None:
                    breakdown[name] = breakdown.get(name, 0) + int(value)
        elif dev.type == "cpu" or dev == HOST_STAND_IN:
            peak_host += total
    return Phase(peak_device, peak_host, breakdown)

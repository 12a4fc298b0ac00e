"""What the planner measures: the layouts and targets it plans, and one rank's memory in
a step (:class:`Footprint`, a peak per phase), extrapolated in depth.

:mod:`usp.planner.measure` runs the steps; this module holds what they give and the
arithmetic on it (the depth line of :func:`scale_depth`, the tracker's snapshots turned
into phases), so the search, the worker pool, the validation and ``--explain`` read
footprints without importing the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from usp.models import Levers

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


@dataclass(frozen=True)
class Choice:
    """One way to run the job that the planner weighs: the grid and the memory levers
    (the object the trainer applies, :class:`usp.models.Levers`). Not the sequence
    layout (zigzag/contiguous), which comes from the config's ``[attention]``; the
    report's text and JSON call a choice's grid its "layout" (``max_seq_len_layout``)."""

    ulysses: int
    ring: int
    dp: int
    levers: Levers = field(default_factory=Levers)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring


@dataclass(frozen=True)
class Target:
    """What is planned: a parsed training config (its [train], [attention] and
    [parallel] placement), the full model, the cluster shape and the device type."""

    job: object  # usp.train.config.TrainJobConfig
    model: object  # the model's config (a usp.models.DecoderConfig), full depth
    world_size: int
    ranks_per_node: int
    device: str  # "cuda" or "cpu"

    @property
    def seq_len(self) -> int:
        return self.job.train.seq_len

    def at(self, seq_len: int) -> Target:
        """The same target at another sequence length."""
        return replace(self, job=self.job.with_train(seq_len=seq_len))


@dataclass(frozen=True)
class Phase:
    """The peak of one phase of a step (a forward, a backward, the optimizer), in bytes.
    ``breakdown`` splits the device peak by what the bytes held at that moment."""

    device: int
    host: int
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Extras:
    """What a measured step shows about memory besides its tracked tensors, in bytes
    (:mod:`usp.planner.overheads` names each in the report):

    ``workspace``: the largest attention call's kernel workspace (already inside the
    phases: the planning kernels allocate it for the call), ``workspace_call`` that call;
    ``pinned``: what torch's pinned allocator adds on the host to the step's pinned
    blocks (each rounded up to a power of two: offloaded layer inputs, offloaded
    parameter and gradient shards); ``offload_copies``: device memory of FSDP2's
    parameter offload that the CPU stand-in never allocates (the largest shard's
    host-to-device copy before its all-gather, the largest unit's reduce-scatter output
    before its copy to the host)."""

    workspace: int = 0
    workspace_call: str = ""
    pinned: int = 0
    offload_copies: int = 0


@dataclass(frozen=True)
class Footprint:
    """One rank's memory in a step: the peak of each phase, in step order."""

    phases: tuple[Phase, ...]
    layers: int
    #: False when host and device are one memory (a CPU run: everything is device
    #: memory, an offload's copies included). A CUDA step planned on the CPU stand-in
    #: counts the offload's host copies apart (on :data:`HOST_STAND_IN`)
    host_separated: bool = True
    extras: Extras = field(default_factory=Extras)

    @property
    def peak(self) -> Phase:
        """The phase with the highest device peak."""
        return max(self.phases, key=lambda p: p.device)

    @property
    def peak_device(self) -> int:
        return self.peak.device

    @property
    def peak_host(self) -> int:
        """The measured host peak (tensors; :attr:`host_total` adds pinned rounding)."""
        return max(p.host for p in self.phases)

    @property
    def host_total(self) -> int:
        """The host peak with the pinned allocator's rounding (what a rank's host holds)."""
        return self.peak_host + self.extras.pinned

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
    # the largest call and the offload copies are the same at every depth (one layer's,
    # or the root's); pinned rounding grows by one layer's blocks per layer
    extras = replace(high.extras, pinned=line(low.extras.pinned, high.extras.pinned))
    return Footprint(phases, layers, host_separated=high.host_separated, extras=extras)


#: the depths measured to extrapolate a deeper model from. From 3 layers on, the backward
#: peak sits in the second layer's backward (the first and the last layer are special:
#: the embedding's gradient, the last layer's parameters kept gathered), so 3 and 4 are
#: the shallowest depths on the backward's line (checked against 6 layers in the tests).
#: Known limit: a forward's peak can still move between 3 and 4 layers (seen for
#: Llama-3.1-70B on u8 x r8: 12.09, 12.24, then +0.38 GiB a layer), so a forward phase is
#: underestimated there; it stays below the backward's peak in every case measured
SCALING_DEPTHS = (3, 4)


def scaling_runs(model) -> tuple[int | tuple[str, ...] | None, ...]:
    """The depths :func:`measure_scaled` runs for ``model``: :data:`SCALING_DEPTHS`, or
    the full depth (``None``) for a model no deeper than the second. A model whose
    layers are of several kinds (``layer_types``: Qwen3.5's linear and full attention,
    Gemma 3's and gpt-oss's sliding and full) runs its first 2 layers and its last
    (the backward's peak sits in the second; the last is kept gathered), then the same
    with one layer of each kind before the last (as ``layer_types`` tuples): a line per
    kind (:func:`scale_kinds`), so no kind is extrapolated as another. (A kind whose
    layer moves the peak into itself has that move counted once per layer of the kind:
    more, never less.)"""
    if model.num_hidden_layers <= SCALING_DEPTHS[1]:
        return (None,)
    kinds = layer_kinds(model)
    if len(set(kinds)) < 2:
        return SCALING_DEPTHS
    head, last = kinds[: SCALING_DEPTHS[0] - 1], kinds[-1:]
    return (head + last, *(head + (kind,) + last for kind in dict.fromkeys(kinds)))


def layer_kinds(model) -> tuple[str, ...]:
    """Each decoder layer's kind (the config's ``layer_kinds``: full, sliding or linear
    attention)."""
    return tuple(model.layer_kinds)


def from_runs(model, runs: list[Footprint]) -> Footprint:
    """The full-depth footprint from the runs of :func:`scaling_runs`, in that order."""
    if len(runs) == 1:
        return runs[0]
    depths = scaling_runs(model)
    if depths == SCALING_DEPTHS:
        low, high = runs
        return scale_depth(low, high, model.num_hidden_layers)
    kinds, base = layer_kinds(model), depths[0]
    added = [kinds.count(d[-2]) - base.count(d[-2]) for d in depths[1:]]
    return scale_kinds(runs[0], list(zip(runs[1:], added)), model.num_hidden_layers)


def scale_kinds(base: Footprint, kinds: list[tuple[Footprint, int]], layers: int) -> Footprint:
    """Extrapolate a model of several layer kinds: ``base`` measured at a few layers,
    each ``(run, count)`` the same with one more layer of a kind and how many more layers
    of that kind the model has; every phase's peak (and each part of its breakdown) adds
    ``count`` times what that kind's layer added (:func:`scale_depth`'s line, one per
    kind)."""

    def line(a: int, bs: list[int]) -> int:
        return a + sum((b - a) * count for b, (_, count) in zip(bs, kinds))

    runs = [run for run, _ in kinds]
    phases = []
    for i, phase in enumerate(base.phases):
        others = [run.phases[i] for run in runs]
        names = dict.fromkeys(k for p in (phase, *others) for k in p.breakdown)
        phases.append(
            Phase(
                line(phase.device, [p.device for p in others]),
                line(phase.host, [p.host for p in others]),
                {
                    k: line(phase.breakdown.get(k, 0), [p.breakdown.get(k, 0) for p in others])
                    for k in names
                },  # fmt: skip
            )
        )
    # the largest call is one layer's (the kind with the largest); pinned rounding grows
    # by one layer's blocks per layer
    widest = max(runs, key=lambda r: r.extras.workspace)
    extras = replace(
        widest.extras,
        pinned=line(base.extras.pinned, [r.extras.pinned for r in runs]),
        offload_copies=max(r.extras.offload_copies for r in runs),
    )
    return Footprint(tuple(phases), layers, host_separated=base.host_separated, extras=extras)


#: the categories that live in host memory with FSDP2's parameter offload: on the CPU
#: stand-in they share the device's memory, so the footprint moves them to the host
OFFLOADED_PARAMETER_CATEGORIES = ("parameters", "gradients", "optimizer_state")


def footprint_of(
    phases: list[dict], device: torch.device, layers: int, planned: str, *,
    host_categories: tuple[str, ...] = (), extras: Extras | None = None,
) -> Footprint:  # fmt: skip
    """The footprint of a step from its tracker snapshots, one per phase."""
    return Footprint(
        tuple(phase_footprint(snapshot, device, host_categories) for snapshot in phases),
        layers,
        host_separated=planned != "cpu",
        extras=extras or Extras(),
    )


def phase_footprint(
    snapshot: dict, device: torch.device, host_categories: tuple[str, ...] = ()
) -> Phase:
    """One phase's peak from the tracker's snapshot: ``device``'s total and breakdown,
    and the host's (the CPU, or :data:`HOST_STAND_IN`). ``host_categories``: breakdown
    categories of ``device`` that are host memory in the planned run (moved there)."""
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
    for name in host_categories:
        moved = breakdown.pop(name, 0)
        peak_device -= moved
        peak_host += moved
    return Phase(peak_device, peak_host, breakdown)

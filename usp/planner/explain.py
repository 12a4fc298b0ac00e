"""What is live at a phase's peak, tensor by tensor: the planner's step, attributed.

:func:`explain` runs the same step as :func:`usp.planner.measure.measure` (the same
``built_step``, the trainer's own step, under ``FakeTensorMode`` and torch's ``FSDPMemTracker``)
with one more dispatch mode on top, :class:`AllocationLog`, which records every storage
an op creates during the step: its bytes, the aten op, the module running (its FQN, and
whether it ran in backward or in an activation-checkpoint recompute), the autograd node
running (for built-in backward formulas) and the innermost ``usp`` source line that
called the op (e.g. ``usp/ring/p2p.py:83 p2p_backward``). Frees are seen through weak
references to the storages, as the tracker sees them.

Each time the tracker's device peak rises, the log copies the tracker's list of live
storages (with the tracker's own category and byte count for each) and joins it with
its records: at the end of a phase, that is exactly what the tracker's peak consisted
of, so the groups add up to the planner's numbers byte for byte, category by category
(checked in ``tests/planner/test_planner_explain.py``). Storages no op of the step created
(parameter shards, optimizer state from before the step, FSDP's parameter buffers it
resizes in place) are grouped as "(not created by an op of the step)".

    python -m usp.planner.explain examples/configs/llama3_8b_1m.toml --seq-len 4194304 \\
        --ulysses 1 --ring 8 --activation-checkpointing offload --mlp-tile-tokens 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from usp.errors import UspError
from usp.planner.footprint import (
    CATEGORIES,
    Choice,
    Extras,
    Footprint,
    Phase,
    Target,
    phase_footprint,
)
from usp.planner.measure import built_step, measure_extras
from usp.planner.plan import _cluster
from usp.planner.report import overhead_lines
from usp.planner.search import Candidate, overheads
from usp.planner.tracker import phase_peak
from usp.train.components import model_source
from usp.train.config import load_train_config

# Paths as code objects name them (not resolved: a checkout reached through a symlink
# must match too); .../usp/ with the separator, so a sibling .../usp-venv/ is not usp.
_USP_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIP_FILES = (os.path.abspath(__file__),)
#: the planner's own frames: an op first called from there came from autograd's
#: built-in backward formulas or the optimizer (then the autograd node names it)
_DRIVER_FILES = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "measure.py"),)


@dataclass
class Record:
    """One storage created by an op of the step."""

    op: str
    where: str  # the innermost usp source line calling the op, or the autograd node
    module: str  # the innermost module running (FQN), "" outside any
    dtype: torch.dtype
    shape: tuple[int, ...]


#: the group of the storages no op of the step created
NOT_CREATED = Record("", "(not created by an op of the step)", "", None, ())


@dataclass(frozen=True)
class Live:
    """Records alive at a peak, grouped by where they were made."""

    nbytes: int
    count: int
    op: str
    where: str
    module: str
    category: str  # the tracker's (see usp.planner.footprint.CATEGORIES)
    dtype: torch.dtype | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Explained:
    """One phase's peak: the tracker's total and breakdown, and what of it the log saw."""

    phase: str
    device: int  # the tracker's device peak, bytes
    breakdown: dict[str, int]
    live: tuple[Live, ...]  # largest first
    tokens: int  # this rank's local tokens in a micro-batch
    extras: Extras = field(default_factory=Extras)  # what the step shows besides

    @property
    def attributed(self) -> int:
        return sum(item.nbytes for item in self.live)

    @property
    def not_created(self) -> int:
        return sum(item.nbytes for item in self.live if item.where == NOT_CREATED.where)

    def category(self, name: str) -> int:
        """Bytes of one tracker category among the attributed records."""
        return sum(item.nbytes for item in self.live if item.category == name)


class AllocationLog(TorchDispatchMode):
    """Records every new storage an op returns (see the module docstring); ``tracker`` is
    the ``FSDPMemTracker`` counting the same step (its module tracker and flags give the
    module and the category, its peak the moment to explain)."""

    def __init__(self, tracker, device: torch.device):
        super().__init__()
        self.tracker = tracker
        self.device = device
        self.records: list[Record] = []
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.at_peak: list[tuple[Record, str, int]] = []
        self._op = None  # the op being dispatched, while it is
        self._watch_peak()
        self._watch_track()

    def _watch_peak(self) -> None:
        tracker, update = self.tracker, self.tracker._update_peak_stats

        def update_and_note(state) -> None:
            before = tracker._peak_mem.get(self.device, 0)
            update(state)
            if tracker._peak_mem.get(self.device, 0) > before:
                self._snapshot()

        tracker._update_peak_stats = update_and_note

    def _watch_track(self) -> None:
        """Storages the tracker first meets in its module hooks rather than as an op's
        output (e.g. a gradient autograd's engine summed in C++): recorded there."""
        tracker, track = self.tracker, self.tracker._track

        def track_and_note(reftype, t) -> None:
            if (
                t.device == self.device
                and not isinstance(t, DTensor)
                and t.untyped_storage() not in tracker._WINFO  # (from before the step)
            ):
                self._note(t, self._op)  # (inside an op: the tracker's dispatch is below ours)
            track(reftype, t)

        tracker._track = track_and_note

    def _snapshot(self) -> None:
        """What the tracker holds on the device now: (record or None, category, bytes)."""
        live = []
        for storage, (info, _) in self.tracker._WINFO.items():
            if info.device != self.device or not info.mem_consumed:
                continue
            index = self._seen.get(storage)
            category = CATEGORIES.get(info.reftype.value, str(info.reftype.value))
            record = NOT_CREATED if index is None else self.records[index]
            live.append((record, category, info.mem_consumed))
        self.at_peak = live

    def restart_peak(self) -> None:
        """The next phase's peak starts from what is live now (as the tracker's does)."""
        self._snapshot()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into local ops first
        self._op = func
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self._op = None
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device == self.device:
                self._note(t, func)
        return out

    def _note(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        op = "(no op: seen in a module hook)" if func is None else func.overloadpacket.__name__
        record = Record(op, _where(), self._module(), t.dtype, tuple(t.shape))
        self._seen[storage] = len(self.records)
        self.records.append(record)

    def _module(self) -> str:
        mods = self.tracker._mod_tracker
        names = [p for p in mods.parents if p != "Global"]
        name = max(names, key=len) if names else ""
        if self.tracker._in_ac:
            return f"{name} (recompute)"
        return f"{name} (backward)" if mods.is_bw else name


def _where() -> str:
    """The innermost usp frame calling the op (``file:line function``), or the autograd
    node running when that frame is the planner's driver (a built-in backward)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_USP_ROOT) and name not in _SKIP_FILES:
            if name in _DRIVER_FILES:
                break
            rel = Path(name).relative_to(Path(_USP_ROOT).parent)
            return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return f"autograd {node.name()}" if node is not None else "(outside usp)"


def group(live: Sequence[tuple[Record, str, int]]) -> list[Live]:
    """(record, category, bytes) grouped by (where, op, module, category, dtype, shape),
    largest first."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for r, category, nbytes in live:
        groups[(r.where, r.op, r.module, category, r.dtype, r.shape)].append(nbytes)
    items = [
        Live(sum(sizes), len(sizes), op, where, module, category, dtype, shape)
        for (where, op, module, category, dtype, shape), sizes in groups.items()
    ]
    return sorted(items, key=lambda item: -item.nbytes)


def explain(target: Target, choice: Choice, *, layers: int = 3) -> list[Explained]:
    """Every phase of one rank's step (``layers`` decoder layers), its peak attributed."""
    explained = []
    with built_step(target, choice, layers=layers, fake=True) as built:
        tracker = FSDPMemTracker(built.model, built.optimizer)
        tokens = built.batches[0].input_ids.numel()
        with tracker:
            log = AllocationLog(tracker, built.device)
            with log:
                for phase in built.phases():
                    snapshot = phase_peak(tracker)
                    peak = phase_footprint(snapshot, built.device)
                    live = group(log.at_peak)
                    explained.append(
                        Explained(phase, peak.device, peak.breakdown, tuple(live), tokens)
                    )
                    log.restart_peak()
                    if phase.startswith("backward"):
                        tracker.reset_mod_stats()
        extras = measure_extras(target, choice, built)
    return [dataclasses.replace(e, extras=extras) for e in explained]


# ----------------------------------------------------------------------------- report
GIB, MIB = 2**30, 2**20


def text(explained: Sequence[Explained], *, top: int = 20, phase: str | None = None) -> str:
    """The peak phase (or ``phase``), its breakdown, and its ``top`` largest live groups
    with their bytes per local token."""
    chosen = (
        max(explained, key=lambda e: e.device)
        if phase is None
        else next(e for e in explained if e.phase == phase)
    )
    lines = [
        f"peak of {chosen.phase}: {chosen.device / GIB:.2f} GiB per rank "
        f"({chosen.tokens:,} local tokens)",
        "  by the tracker: "
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in chosen.breakdown.items() if v),
        f"  attributed below: {chosen.attributed / GIB:.2f} GiB, of which not created by "
        f"an op of the step {chosen.not_created / GIB:.2f}",
        "",
        "| MiB | B/token | n | category | dtype | shape | op | where | module |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for item in chosen.live[:top]:
        dtype = str(item.dtype).removeprefix("torch.") if item.dtype else ""
        lines.append(
            f"| {item.nbytes / MIB:,.1f} | {item.nbytes / chosen.tokens:,.0f} | {item.count} | "
            f"{item.category} | {dtype} | {list(item.shape)} | {item.op} | {item.where} | "
            f"{item.module} |"
        )
    rest = chosen.live[top:]
    if rest:
        lines.append(
            f"| {sum(i.nbytes for i in rest) / MIB:,.1f} | "
            f"{sum(i.nbytes for i in rest) / chosen.tokens:,.0f} | "
            f"{sum(i.count for i in rest)} | (the rest) | | | | | |"
        )
    return "\n".join(lines)


def overheads_text(explained: Sequence[Explained], target: Target, choice: Choice, cluster) -> str:
    """What the GPU and the host spend besides the tracked tensors of the peak phase
    (:mod:`usp.planner.overheads`, the lines ``usp plan`` prints), at this depth."""
    chosen = max(explained, key=lambda e: e.device)
    footprint = Footprint((Phase(chosen.device, 0, chosen.breakdown),), 0, extras=chosen.extras)
    costs = overheads(target, choice, cluster)
    candidate = Candidate(choice, target.seq_len, footprint, True, None, 0.0, {}, costs)
    lines = [
        "",
        "what the GPU and the host hold besides (usp plan's items, usp.planner.overheads):",
    ]
    return "\n".join(lines + overhead_lines(candidate, cluster))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m usp.planner.explain",
        description="What is live at the peak of one rank's planned step, tensor by tensor.",
    )
    p.add_argument("config")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--ring", type=int, default=None, help="default: world / ulysses / dp")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument(
        "--activation-checkpointing", default="true", choices=["true", "false", "offload"]
    )
    p.add_argument("--mlp-tile-tokens", type=int, default=0)
    p.add_argument("--attention-head-chunks", type=int, help="overrides [train]")
    p.add_argument("--layers", type=int, default=3, help="decoder layers built (default 3)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--phase", help="explain this phase (default: the highest peak)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--offload-optimizer", action="store_true", help="[train] offload_optimizer")
    p.add_argument(
        "--offload-parameters",
        action="store_true",
        help="[train] offload_parameters (and the optimizer)",
    )
    args = p.parse_args(argv)
    try:
        job = load_train_config(args.config, seq_len=args.seq_len)
        cluster = job.topology.cluster
        world = cluster.nodes * cluster.gpus_per_node
        ring = args.ring or world // (args.ulysses * args.dp)
        checkpointing = {"true": True, "false": False}.get(
            args.activation_checkpointing, args.activation_checkpointing
        )
        target = Target(job, model_source(job).config, world, cluster.gpus_per_node, args.device)
        levers = job.train.levers.replace(
            activation_checkpointing=checkpointing, mlp_tile_tokens=args.mlp_tile_tokens
        )
        if args.attention_head_chunks is not None:
            levers = levers.replace(attention_head_chunks=args.attention_head_chunks)
        if args.offload_optimizer or args.offload_parameters:
            levers = levers.replace(
                offload_optimizer=True, offload_parameters=args.offload_parameters
            )
        choice = Choice(args.ulysses, ring, args.dp, levers)
        explained = explain(target, choice, layers=args.layers)
        planned = _planned_cluster(job, args.device)
    except UspError as err:
        print(f"explain: error: {err}", file=sys.stderr)
        return 2
    print(text(explained, top=args.top, phase=args.phase))
    print(overheads_text(explained, target, choice, planned))
    return 0


def _planned_cluster(job, device: str):
    """The config's cluster as ``usp plan`` plans it (the GPU's memory from its name)."""
    cluster = job.topology.cluster
    return _cluster(job, cluster.nodes, cluster.gpus_per_node, None, None, device)[0]


if __name__ == "__main__":
    raise SystemExit(main())

"""The planner held against a real step: the same step run with real tensors, its
memory measured without the tracker the planner uses.

:func:`real_peak` builds the step of :func:`usp.planner.measure.measure` with real
tensors (on the ``fake`` process group: collectives move no data, which changes no
allocation) and runs it under ``torch.profiler`` with ``profile_memory=True``. The
profiler reports every allocation and free of the CPU allocator in order; the step's
peak is the memory alive when profiling starts (every tensor the model, the optimizer
and the batch hold, counted once per storage) plus the highest running sum of those
events. Nothing here reads ``FSDPMemTracker``.

On CUDA, :func:`real_peak` reads ``torch.cuda.max_memory_allocated`` instead (what
``benchmarks/gpu_check.sh`` compares the planner with).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from usp.planner.footprint import Choice, Target
from usp.planner.measure import built_step


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _live_tensors(built) -> list[torch.Tensor]:
    tensors = list(built.model.parameters()) + list(built.model.buffers())
    for state in built.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for batch in built.batches:
        tensors += [batch.input_ids, batch.labels, batch.position_ids]
    return tensors


def _peak_of_events(events) -> int:
    running, peak = 0, 0
    for nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def real_peak(target: Target, choice: Choice, *, layers: int | None = None) -> int:
    """Bytes: the highest memory one real step of ``layout`` allocated on this rank
    (after a first optimizer step, as the planner measures it)."""
    with built_step(target, choice, layers=layers, fake=False) as built:
        if built.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _phase in built.phases():
                pass
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        baseline = _storage_bytes(_live_tensors(built))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for _phase in built.phases():
                pass
        events = [
            e.nbytes()
            for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
    return baseline + _peak_of_events(events)

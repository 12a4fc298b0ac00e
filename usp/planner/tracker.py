"""The planner's memory tracker: torch's ``FSDPMemTracker`` with less bookkeeping per op.

:class:`PlanningTracker` counts the same bytes as ``FSDPMemTracker`` and reports the same
global peak (``get_tracker_snapshot("peak")``, all the planner reads), faster:

- **Ops that return no tensor** (``prim.device``, ``aten.sym_size``, ``is_contiguous``,
  ``promote_types``, ...: every ``.device`` query on a fake tensor is one, more than half
  of a step's dispatched ops) skip the tracker's result walk, which has nothing to track
  in them. They still update the peak, as the plain tracker does after every op (the
  current total can have grown since the last op, in FSDP's hooks).
- **The peak update keeps the global peak only**: the plain tracker also walks every
  module it has seen, per op, to keep per-module peaks (``memory_tracking``'s
  ``PEAK_FW``/``PEAK_BW`` snapshots); the planner reads none of them, and the global peak
  never depends on them. And it does nothing when the current snapshot has not changed
  since the last update (a view, a metadata query): the peak is a maximum of the
  current total, which has not moved.

Exactness: both changes leave every allocation, free and category of the tracker's
current snapshot as they were, and the global peak is the same maximum over the same
points; ``tests/planner/test_planner_speed.py`` checks that every phase's footprint equals the
plain tracker's byte for byte.
"""

from __future__ import annotations

from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor

#: the key of a snapshot's total (``torch.distributed._tools.mem_tracker``'s)
TOTAL = "Total"


def returns_no_tensor(func) -> bool:
    """Whether an op's schema returns no tensor (``Device``, ``int``, ``bool``, nothing):
    then its result holds nothing for a tracker to track. Any return type that names a
    tensor (``Tensor``, ``Tensor?``, ``Tensor[]``, ...) does not qualify."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return not any("Tensor" in str(ret.type) for ret in schema.returns)


class PlanningTracker(FSDPMemTracker):
    """``FSDPMemTracker`` for the planner: same bytes, same global peak, no per-module
    peaks (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._no_tensor: dict[object, bool] = {}
        self._changed = True  # the current snapshot changed since the last peak update

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        no_tensor = self._no_tensor.get(func)
        if no_tensor is None:
            no_tensor = self._no_tensor[func] = returns_no_tensor(func)
        if not no_tensor or DTensor in types:
            return super().__torch_dispatch__(func, types, args, kwargs)
        result = func(*args, **(kwargs or {}))
        if self._changed and active_fake_mode() is self._fake_mode_on_entry:
            self._update_peak_stats(None)
        return result

    def _update_snap(self, *args, **kwargs) -> None:
        self._changed = True  # (every change of the current snapshot comes through here)
        super()._update_snap(*args, **kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        """The global peak per device (the plain tracker's second half; its first keeps
        the per-module peaks, which nothing here reads). Unchanged since the last
        update, the current snapshot cannot raise the peak: nothing to do."""
        if not self._changed:
            return
        self._changed = False
        for device, snapshot in self._curr_mem_snap.items():
            total = snapshot[TOTAL]
            if self._peak_mem.get(device, 0) < total:
                self._peak_mem[device] = total
                self._peak_mem_snap[device] = dict(snapshot)  # {category: int}


def phase_peak(tracker) -> dict:
    """The peak since the last call, then start the next phase's peak from now (what the
    tracker does on entry; its peak is otherwise one number for the whole session)."""
    peak = tracker.get_tracker_snapshot("peak")
    now = tracker.get_tracker_snapshot("current")
    tracker._peak_mem_snap = now
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in now.items()}
    return peak

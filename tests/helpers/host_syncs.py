"""A detector of host syncs inside usp's attention (tests/attention/test_plan.py), and the
frame filter it names them with: usp's own frames, found by the usp package's directory,
never by a path fragment (a filter matching "/usp/" once took torch's frames for usp's in
a checkout named ``usp`` whose .venv lies inside it)."""

from __future__ import annotations

import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import usp

#: usp's package directory as its modules' code objects name it, with the separator
PACKAGE = os.path.dirname(usp.__file__) + os.sep
#: the one kernel that may read its tensors on the host (its tensors are CPU tensors)
CPU_KERNEL = "usp/kernels/backends/cpu.py"


def usp_frames(filenames_and_lines, package: str = PACKAGE) -> list[str]:
    """``usp/<module path>:<line>`` of the frames inside ``package``, outermost first."""
    return [
        f"usp/{name[len(package) :].replace(os.sep, '/')}:{line}"
        for name, line in filenames_and_lines
        if name.startswith(package)
    ]


class HostSyncs(TorchDispatchMode):
    """Counts ops that read a tensor's value on the host (``.item()``; on CUDA a sync)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.exempted = 0  # reads by the CPU kernel (no host sync)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default):
            where = usp_frames((f.filename, f.lineno) for f in traceback.extract_stack())
            # the CPU-only kernel may read its CPU tensors: that is no host sync
            if any(f.startswith(CPU_KERNEL) for f in where[-1:]):
                self.exempted += 1
            else:
                self.calls.append(f"{func} at {' <- '.join(reversed(where))}")
        return func(*args, **(kwargs or {}))

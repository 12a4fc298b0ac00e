"""Kernels from optional packages (fla, causal-conv1d): the parts every one shares.

A :class:`PackageKernel` is a function of an optional package, imported on first use,
with the limits every such kernel states (installed, device types, dtypes, importable)
and a self-check verdict cached per key (:meth:`PackageKernel.verdict`). A subclass
declares only what is its own: the package's module and function, its further limits
(:meth:`PackageKernel.own_limits`) and how it checks itself (:meth:`PackageKernel.check`,
run through :func:`self_check`). Which kernel runs a call is
:func:`usp.kernels.selection.choose`.

Triton's interpreter: fla's kernels are Triton programs, which Triton runs on CPU tensors
when ``TRITON_INTERPRET=1`` is set before the package is imported. A kernel with
``interpretable = True`` then accepts CPU tensors too (and ``auto`` takes it there once
its self-check passes). An interpreted run is a test mode (CI runs fla's mapping so):
it is exact but orders of magnitude slower than usp's torch kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from usp.compile_marks import compiler_disabled
from usp.errors import InputError
from usp.kernels.backends.base import BackendFailure

__all__ = [
    "Kernel",
    "PackageKernel",
    "compare_results",
    "interpreted",
    "relative_error",
    "self_check",
]

LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def interpreted() -> bool:
    """Whether Triton runs its programs in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


class Kernel:
    """A kernel of a seam (the linear mixers' recurrences and convs): usp's own torch code
    has no limits and needs no self-check; :class:`PackageKernel` has both."""

    name: str = ""

    def limits_reason(self, device: torch.device, dtype: torch.dtype, *shape) -> str | None:
        """None if this kernel can run calls of this device, activation dtype and shape
        (before any self-check), else why not."""
        return None

    def verdict(self, device: torch.device, dtype: torch.dtype, *shape) -> str | None:
        """None if the kernel passed its self-check for these (cached), else why not."""
        return None


class PackageKernel(Kernel):
    """A function of an optional package (or the given ``function``, which takes its
    signature: tests hand in stand-ins), with its stated limits and cached verdicts."""

    name: str = ""
    #: the function's name in ``module``
    attribute: str = ""
    #: what to install, as a refusal says it
    install: str = ""
    #: the error a failed import raises at call time
    error: type[InputError] = InputError
    #: a Triton kernel: runs on CPU tensors under Triton's interpreter
    interpretable: bool = False

    def __init__(
        self,
        function=None,
        *,
        module: str,
        device_types: tuple[str, ...] = ("cuda",),
        dtypes: tuple[torch.dtype, ...] = LOW_PRECISION,
    ):
        self._function = function
        self.module = module
        self._device_types = device_types
        self.dtypes = dtypes
        self._installed: bool | None = None  # looked up once: auto asks on every call
        self._import_error: str | None = None
        self._verdicts: dict[tuple, str | None] = {}

    @property
    def device_types(self) -> tuple[str, ...]:
        if self.interpretable and interpreted() and "cpu" not in self._device_types:
            return (*self._device_types, "cpu")
        return self._device_types

    def installed(self) -> bool:
        if self._installed is None:
            found = importlib.util.find_spec(self.module.split(".")[0]) is not None
            self._installed = self._function is not None or found
        return self._installed

    def function(self):
        """The package's function (imported on first use); raises :attr:`error` if the
        import fails."""
        if self._function is None and self._import_error is None:
            try:
                self._function = getattr(importlib.import_module(self.module), self.attribute)
            except Exception as err:  # a broken install fails at import in many ways
                self._import_error = f"{type(err).__name__}: {str(err)[:300]}"
        if self._function is None:
            raise self.error(f"{self.module} does not import ({self._import_error})")
        return self._function

    def limits_reason(self, device: torch.device, dtype: torch.dtype, *shape) -> str | None:
        """None if this kernel can run calls of this device, activation dtype and
        ``shape`` (what :meth:`own_limits` reads), before any self-check; else why not (a
        :class:`BackendFailure` when it is installed but does not import)."""
        if not self.installed():
            where = "" if device.type in self.device_types else " and a CUDA device"
            return f"needs {self.install}{where}, which is not installed"
        if device.type not in self.device_types:
            return f"runs on {'/'.join(self.device_types)}, not {device.type}"
        if dtype not in self.dtypes:
            return f"runs {', '.join(str(d) for d in self.dtypes)}, not {dtype}"
        reason = self.own_limits(*shape)
        if reason is not None:
            return reason
        try:
            self.function()
        except InputError as err:
            return BackendFailure(f"is installed but {err}")
        return None

    def own_limits(self, *shape) -> str | None:
        """The kernel's own limits on the call's shape (head dims, widths, channels)."""
        return None

    def verdict(self, device: torch.device, dtype: torch.dtype, *shape) -> str | None:
        """None if the kernel passed its self-check for (device, dtype, shape) (run once,
        then cached), else why not (a :class:`BackendFailure`)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, dtype, *shape)
        if key not in self._verdicts:
            self._verdicts[key] = self_check(
                lambda: self.check(device, dtype, *shape),
                ", ".join([str(device), str(dtype), *self.describe_shape(*shape)]),
                device.type,
            )
        return self._verdicts[key]

    def describe_shape(self, *shape) -> list[str]:
        return [str(n) for n in shape]

    def check(self, device: torch.device, dtype: torch.dtype, *shape) -> str | None:
        """Compare a small call with usp's torch kernel; None or what disagreed."""
        raise NotImplementedError


@compiler_disabled
def self_check(compare, where: str, device_type: str) -> str | None:
    """Run ``compare()`` (None, or what disagreed) with gradients on and autocast off on
    ``device_type``, whatever the caller's context (a first call may come under no_grad,
    e.g. in evaluation, or autocast): None if it passed, else a :class:`BackendFailure`
    saying where and why."""
    try:
        no_autocast = torch.autocast(device_type, enabled=False)
        with torch.inference_mode(False), torch.enable_grad(), no_autocast:
            problem = compare()
    except Exception as err:  # any failure means: do not use this kernel here
        problem = f"{type(err).__name__}: {str(err)[:300]}"
    if problem is None:
        return None
    return BackendFailure(f"failed its self-check on {where} ({problem})")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| in float64 (inf for a non-finite result)."""
    actual, expected = actual.double(), expected.double()
    if not bool(torch.isfinite(actual).all()):
        return float("inf")
    scale = max(expected.abs().max().item(), 1e-6)
    return (actual - expected).abs().max().item() / scale


def compare_results(names, actual, expected, bound: float, note: str) -> str | None:
    """The first of ``names`` whose result is off by more than ``bound`` (relative), or
    whose shape differs, as a self-check's problem; None when all agree."""
    for name, a, e in zip(names, actual, expected):
        if a.shape != e.shape:
            return f"{name} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        err = relative_error(a, e)
        if not err <= bound:
            return f"{name} off by {err:.2g} relative (bound {bound:g}){note}"
    return None

"""The short convolution of a Gated DeltaNet layer: torch's grouped ``conv1d``, or the
``causal-conv1d`` package's CUDA kernel (``pip install 'usp[fla]'``).

The seam (:meth:`ConvKernel.run`): the depthwise causal conv of segments x [N, L, C]
after their left contexts [N, K-1, C] (the ring's tails; zeros at a document's start)
with weight [C, K], no bias, then the activation (None or "silu"); returns [N, L, C] in
x's dtype (the compute dtype), differentiable in x, the weight and the contexts.

Choice (``conv_kernel=`` of :func:`usp.linear.gated_deltanet_usp` and
:class:`usp.linear.GatedDeltaNet`): ``"auto"`` takes ``causal_conv1d`` where it can run
the call (CUDA, float32/bfloat16/float16 activations, K from 2 to 4, channels a multiple
of 8: its channel-last kernel, the one with initial states) and passed its self-check,
else ``torch``; ``"torch"`` or ``"causal_conv1d"`` forces one (refused with the reason
when it cannot run). causal-conv1d runs in the activations' dtype when that is
bfloat16/float16 (its contexts too), the weight in its own. Self-check: before its first
call for a (device, dtype, K), a small call (contexts non-zero, both activations, forward
and backward) is compared with the torch conv in float64 on the same device. Not yet run
on a GPU (its cases are in tests/kernels/test_new_paths_device.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch
import torch.nn.functional as F

from usp.compile_marks import compiler_disabled
from usp.errors import InputError
from usp.kernels.backends.base import BackendFailure
from usp.kernels.selection import report_auto_skip
from usp.options import LINEAR_CONV_BACKENDS

__all__ = [
    "CONV_KERNELS",
    "CausalConv1dKernel",
    "ConvKernel",
    "ConvKernelError",
    "TorchConvKernel",
    "select_conv_kernel",
]

logger = logging.getLogger("usp.linear")

#: the names ``conv_kernel=`` takes: ``[attention] linear_conv_backend``'s
CONV_KERNELS: tuple[str, ...] = LINEAR_CONV_BACKENDS
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class ConvKernelError(InputError):
    """A short-conv kernel that is unknown or cannot run the call here."""


class ConvKernel:
    name: str = ""

    def limits_reason(self, device, dtype, channels: int, width: int) -> str | None:
        return None

    def verdict(self, device, dtype, width: int) -> str | None:
        return None

    def run(self, x, weight, context, activation, *, io_dtype):
        raise NotImplementedError


class TorchConvKernel(ConvKernel):
    name = "torch"

    def run(self, x, weight, context, activation, *, io_dtype):
        full = torch.cat([context, x], dim=1).transpose(1, 2)  # [N, C, K-1+L]
        out = F.conv1d(full, weight.to(full.dtype)[:, None, :], groups=full.shape[1])
        out = out.transpose(1, 2)  # [N, L, C]
        return F.silu(out) if activation == "silu" else out


class CausalConv1dKernel(ConvKernel):
    """``causal_conv1d.causal_conv1d_fn`` (or the given ``function``, which takes its
    signature: tests hand in a stand-in)."""

    name = "causal_conv1d"

    def __init__(
        self,
        function=None,
        *,
        module: str = "causal_conv1d",
        device_types: tuple[str, ...] = ("cuda",),
        dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
        channel_multiple: int = 8,  # its channel-last kernel's rule
    ):
        self._function = function
        self.channel_multiple = channel_multiple
        self.module = module
        self.device_types = device_types
        self.dtypes = dtypes
        self._installed: bool | None = None
        self._import_error: str | None = None
        self._verdicts: dict[tuple, str | None] = {}

    def installed(self) -> bool:
        if self._installed is None:
            found = importlib.util.find_spec(self.module.split(".")[0]) is not None
            self._installed = self._function is not None or found
        return self._installed

    def function(self):
        if self._function is None and self._import_error is None:
            try:
                self._function = importlib.import_module(self.module).causal_conv1d_fn
            except Exception as err:  # a CUDA extension fails at import in many ways
                self._import_error = f"{type(err).__name__}: {str(err)[:300]}"
        if self._function is None:
            raise ConvKernelError(f"{self.module} does not import ({self._import_error})")
        return self._function

    def limits_reason(self, device, dtype, channels, width):
        if not self.installed():
            where = "" if device.type in self.device_types else " and a CUDA device"
            return f"needs causal-conv1d (pip install 'usp[fla]'){where}, which is not installed"
        if device.type not in self.device_types:
            return f"runs on {'/'.join(self.device_types)}, not {device.type}"
        if dtype not in self.dtypes:
            return f"runs {', '.join(str(d) for d in self.dtypes)}, not {dtype}"
        if not 2 <= width <= 4:
            return f"takes kernel sizes 2 to 4, not {width}"
        if channels % self.channel_multiple:
            return (
                f"takes channel counts that are multiples of {self.channel_multiple} (with "
                f"initial states), not {channels}"
            )
        try:
            self.function()
        except ConvKernelError as err:
            return BackendFailure(f"is installed but {err}")
        return None

    def verdict(self, device, dtype, width):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, dtype, width)
        if key not in self._verdicts:
            self._verdicts[key] = _self_check(self, device, dtype, width)
        return self._verdicts[key]

    def run(self, x, weight, context, activation, *, io_dtype):
        low = io_dtype if io_dtype in (torch.bfloat16, torch.float16) else x.dtype
        # channel-last [N, C, L] views of [N, L, C] memory: the layout that takes contexts
        xs = x.to(low).contiguous().transpose(1, 2)
        states = context.to(low).contiguous().transpose(1, 2)  # [N, C, K-1]
        out = self.function()(xs, weight, None, None, states, False, None, activation)
        return out.transpose(1, 2).to(x.dtype)


# ------------------------------------------------------------------ self-check
@compiler_disabled
def _self_check(kernel, device, dtype, width) -> str | None:
    try:
        no_autocast = torch.autocast(device.type, enabled=False)
        with torch.inference_mode(False), torch.enable_grad(), no_autocast:
            problem = _compare_with_torch(kernel, device, dtype, width)
    except Exception as err:  # any failure means: do not use this kernel here
        problem = f"{type(err).__name__}: {str(err)[:300]}"
    if problem is None:
        return None
    return BackendFailure(f"failed its self-check on {device}, {dtype}, K={width} ({problem})")


def _compare_with_torch(kernel, device, dtype, width) -> str | None:
    gen = torch.Generator().manual_seed(7)
    n, length, channels = 3, 21, 16
    x, dout = (torch.randn(n, length, channels, generator=gen, dtype=torch.float64) for _ in "xd")
    context = torch.randn(n, width - 1, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, width, generator=gen, dtype=torch.float64) * 0.5
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    for activation in ("silu", None):
        results = []
        for impl, run_dtype, in_dtype in ((TorchConvKernel(), torch.float64, torch.float64),
                                          (kernel, dtype, compute)):  # fmt: skip
            leaves = [t.to(device, in_dtype).requires_grad_() for t in (x, weight, context)]
            out = impl.run(leaves[0], leaves[1], leaves[2], activation, io_dtype=run_dtype)
            grads = torch.autograd.grad(out, leaves, dout.to(device, out.dtype))
            results.append([out, *grads])
        for name, actual, expected in zip(("out", "dx", "dweight", "dcontext"), *results[::-1]):
            actual, expected = actual.double(), expected.double()
            err = (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
            if not err <= _TOLERANCE[dtype]:
                return f"{name} off by {err:.2g} relative (bound {_TOLERANCE[dtype]:g}), activation={activation}"
    return None


# ------------------------------------------------------------------ choice


def select_conv_kernel(
    name: str, device, dtype, channels: int, width: int, kernels=None
) -> ConvKernel:
    """The kernel of a conv of ``channels`` channels and kernel size ``width`` over
    activations of ``dtype``: the named one, or for ``auto`` causal_conv1d where it can,
    else torch. ``kernels``: {"torch": ..., "causal_conv1d": ...} (default usp's)."""
    kernels = DEFAULT if kernels is None else kernels
    if name not in CONV_KERNELS:
        raise ConvKernelError(f"unknown conv kernel {name!r}; valid: {', '.join(CONV_KERNELS)}")
    fast = kernels["causal_conv1d"]
    if name == "torch":
        return kernels["torch"]
    reason = fast.limits_reason(device, dtype, channels, width) or fast.verdict(
        device, dtype, width
    )
    if reason is None:
        return fast
    if name != "auto":
        raise ConvKernelError(
            f"conv kernel {name!r} cannot run this call ({device.type}, {dtype}, "
            f"{channels} channels, K={width}): it {reason}. conv_kernel='auto' or 'torch' "
            "runs it with torch's conv1d"
        )
    report_auto_skip("conv kernel", fast.name, reason, "torch", logger, stacklevel=3)
    return kernels["torch"]


#: usp's kernels
DEFAULT = {"torch": TorchConvKernel(), "causal_conv1d": CausalConv1dKernel()}

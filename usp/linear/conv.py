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

import logging

import torch
import torch.nn.functional as F

from usp.errors import InputError
from usp.kernels.optional import Kernel, PackageKernel, compare_results
from usp.kernels.selection import choose
from usp.options import LINEAR_CONV_BACKENDS

__all__ = [
    "CONV_KERNELS",
    "CausalConv1dKernel",
    "ConvKernel",
    "ConvKernelError",
    "TorchConvKernel",
    "select_conv_kernel",
]

#: the names ``conv_kernel=`` takes: ``[attention] linear_conv_backend``'s
CONV_KERNELS: tuple[str, ...] = LINEAR_CONV_BACKENDS


class ConvKernelError(InputError):
    """A short-conv kernel that is unknown or cannot run the call here."""


class ConvKernel(Kernel):
    """One implementation of the seam; its limits read (channels, width), its self-check
    the width."""

    def run(self, x, weight, context, activation, *, io_dtype, bias=None):
        raise NotImplementedError


class TorchConvKernel(ConvKernel):
    name = "torch"

    def run(self, x, weight, context, activation, *, io_dtype, bias=None):
        full = torch.cat([context, x], dim=1).transpose(1, 2)  # [N, C, K-1+L]
        bias = None if bias is None else bias.to(full.dtype)
        out = F.conv1d(full, weight.to(full.dtype)[:, None, :], bias, groups=full.shape[1])
        out = out.transpose(1, 2)  # [N, L, C]
        return F.silu(out) if activation == "silu" else out


class CausalConv1dKernel(PackageKernel, ConvKernel):
    """``causal_conv1d.causal_conv1d_fn`` (or the given ``function``, which takes its
    signature: tests hand in a stand-in)."""

    name = "causal_conv1d"
    attribute = "causal_conv1d_fn"
    install = "causal-conv1d (pip install 'usp[fla]')"
    error = ConvKernelError

    def __init__(self, function=None, *, module="causal_conv1d", channel_multiple=8, **limits):
        """``channel_multiple``: its channel-last kernel's rule; ``limits``: device_types,
        dtypes (:class:`PackageKernel`)."""
        super().__init__(function, module=module, **limits)
        self.channel_multiple = channel_multiple

    def own_limits(self, channels, width):
        if not 2 <= width <= 4:
            return f"takes kernel sizes 2 to 4, not {width}"
        if channels % self.channel_multiple:
            return (
                f"takes channel counts that are multiples of {self.channel_multiple} (with "
                f"initial states), not {channels}"
            )
        return None

    def describe_shape(self, width):
        return [f"K={width}"]

    def check(self, device, dtype, width):
        return _compare_with_torch(self, device, dtype, width)

    def run(self, x, weight, context, activation, *, io_dtype, bias=None):
        low = io_dtype if io_dtype in (torch.bfloat16, torch.float16) else x.dtype
        # channel-last [N, C, L] views of [N, L, C] memory: the layout that takes contexts
        xs = x.to(low).contiguous().transpose(1, 2)
        states = context.to(low).contiguous().transpose(1, 2)  # [N, C, K-1]
        out = self.function()(xs, weight, bias, None, states, False, None, activation)
        return out.transpose(1, 2).to(x.dtype)


# ------------------------------------------------------------------ self-check
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _compare_with_torch(kernel, device, dtype, width) -> str | None:
    """Contexts non-zero, a bias, both activations, forward and backward, against the
    torch conv in float64 on the same device."""
    gen = torch.Generator().manual_seed(7)
    n, length, channels = 3, 21, 16
    x, dout = (torch.randn(n, length, channels, generator=gen, dtype=torch.float64) for _ in "xd")
    context = torch.randn(n, width - 1, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, width, generator=gen, dtype=torch.float64) * 0.5
    bias = torch.randn(channels, generator=gen, dtype=torch.float64) * 0.3
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    for activation in ("silu", None):
        results = []
        for impl, run_dtype, in_dtype in ((TorchConvKernel(), torch.float64, torch.float64),
                                          (kernel, dtype, compute)):  # fmt: skip
            leaves = [t.to(device, in_dtype).requires_grad_() for t in (x, weight, context, bias)]
            out = impl.run(*leaves[:3], activation, io_dtype=run_dtype, bias=leaves[3])
            grads = torch.autograd.grad(out, leaves, dout.to(device, out.dtype))
            results.append([out, *grads])
        names = ("out", "dx", "dweight", "dcontext", "dbias")
        problem = compare_results(names, *results[::-1], _TOLERANCE[dtype],
                                  f", activation={activation}")  # fmt: skip
        if problem is not None:
            return problem
    return None


# ------------------------------------------------------------------ choice
def select_conv_kernel(
    name: str, device, dtype, channels: int, width: int, kernels=None
) -> ConvKernel:
    """The kernel of a conv of ``channels`` channels and kernel size ``width`` over
    activations of ``dtype``: the named one, or for ``auto`` causal_conv1d where it can,
    else torch. ``kernels``: {"torch": ..., "causal_conv1d": ...} (default usp's)."""
    kernels = DEFAULT if kernels is None else kernels

    return choose(
        name, ("torch", "causal_conv1d"), kernels.__getitem__,
        lambda _, kernel: kernel.limits_reason(device, dtype, channels, width)
        or kernel.verdict(device, dtype, width),
        order=("causal_conv1d", "torch"), kind="conv kernel",
        call=f"this call ({device.type}, {dtype}, {channels} channels, K={width})", log=logging.getLogger(__name__),
        unknown=ConvKernelError, unable=ConvKernelError,
        fix=lambda: "conv_kernel='auto' or 'torch' runs it with torch's conv1d",
    )  # fmt: skip


#: usp's kernels
DEFAULT = {"torch": TorchConvKernel(), "causal_conv1d": CausalConv1dKernel()}

"""The kernels of the scalar-decay scan (Mamba-2's SSD) behind one seam: usp's torch
kernel (:mod:`usp.linear.scan`), and fla's simple-GLA Triton kernel (``fla-core``:
``pip install 'usp[fla]'``) on CUDA (or on CPU tensors under Triton's interpreter).

The seam (:meth:`ScanKernel.run`): independent rows in the padded layout -- q, k
[N, L, H, dk] (groups already expanded to heads), v [N, L, H, dv], g (log decay <= 0)
[N, L, H], all in the compute dtype, row i holding ``lengths[i]`` tokens, zeros after
them -- run from a zero state (the ring composes the start states, :mod:`usp.linear.ssd`).
Returns (o [N, L, H, dv], final states [N, H, dk, dv]) in the compute dtype,
differentiable in every input.

Choice (``kernel=`` of :func:`usp.linear.mamba2_usp`; the plan's ``linear_backend``):
``"auto"`` takes ``fla`` where it can run the call (CUDA, float32/bfloat16/float16
activations, dk <= 256, fla importable) and passed its self-check there, else
``torch``. fla runs q, k, v in the activations' dtype when that is bfloat16/float16, the
decay and the states in float32, with ``scale=1`` and the rows packed into one
``cu_seqlens`` call. Self-check: before fla's first call for a (device, dtype, dk, dv),
rows of unequal lengths and an empty one, forward and the backward of both outputs,
against the torch kernel in float64 on the same device. Not yet run on a GPU.
"""

from __future__ import annotations

import logging

import torch

from usp.errors import InputError
from usp.kernels.optional import Kernel, PackageKernel, compare_results
from usp.kernels.selection import choose
from usp.linear.fla_rows import run_packed
from usp.linear.kernel import compute_dtype
from usp.linear.scan import scalar_decay_padded

__all__ = [
    "DEFAULT", "FlaScanKernel", "ScanKernel", "ScanKernelError", "TorchScanKernel",
    "select_scan_kernel",
]  # fmt: skip


class ScanKernelError(InputError):
    """A scan kernel that is unknown or cannot run the call here."""


class ScanKernel(Kernel):
    """One implementation of the seam; its limits read the state's key dim, its
    self-check (dk, dv)."""

    def run(self, q, k, v, g, *, lengths, chunk_size, io_dtype):
        raise NotImplementedError


class TorchScanKernel(ScanKernel):
    """usp's chunked kernel in torch (any device and dtype; padding is exact for it)."""

    name = "torch"

    def run(self, q, k, v, g, *, lengths, chunk_size, io_dtype):
        return scalar_decay_padded(q, k, v, g, chunk_size=chunk_size)


class FlaScanKernel(PackageKernel, ScanKernel):
    """fla's ``chunk_simple_gla`` (or the given ``function``, which takes its signature)."""

    name = "fla"
    attribute = "chunk_simple_gla"
    install = "fla (pip install 'usp[fla]')"
    error = ScanKernelError
    interpretable = True

    def __init__(self, function=None, *, module="fla.ops.simple_gla", max_key_dim=256, **limits):
        super().__init__(function, module=module, **limits)
        self.max_key_dim = max_key_dim

    def own_limits(self, dk):
        if dk > self.max_key_dim:
            return f"takes state sizes up to {self.max_key_dim}, not {dk}"
        return None

    def describe_shape(self, dk, dv):
        return [f"dk={dk}", f"dv={dv}"]

    def check(self, device, dtype, dk, dv):
        return _compare_with_torch(self, device, dtype, dk, dv)

    def run(self, q, k, v, g, *, lengths, chunk_size, io_dtype):
        compute = v.dtype
        low = io_dtype if io_dtype in (torch.bfloat16, torch.float16) else compute
        return run_packed(
            self.function(), [(q, low), (k, low), (v, low), (g, compute)], compute=compute,
            lengths=lengths, initial_state=None, state_shape=(q.shape[2], q.shape[3], v.shape[3]),
            scale=1.0,
        )  # fmt: skip


#: usp's kernels
DEFAULT = {"torch": TorchScanKernel(), "fla": FlaScanKernel()}

# ------------------------------------------------------------------ self-check
_CHECK_LENGTHS = (40, 23, 0, 17)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-2, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def _compare_with_torch(kernel, device, dtype, dk, dv) -> str | None:
    gen = torch.Generator().manual_seed(2025)
    n, length, heads = len(_CHECK_LENGTHS), max(_CHECK_LENGTHS), 2
    valid = torch.arange(length)[None, :] < torch.tensor(_CHECK_LENGTHS)[:, None]
    mask = valid[..., None, None].double()

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(n, length, heads, dk) * dk**-0.5, randn(n, length, heads, dk) * 0.5
    v = randn(n, length, heads, dv)
    g = -torch.rand(n, length, heads, generator=gen, dtype=torch.float64) * 0.5
    q, k, v, g = q * mask, k * mask, v * mask, g * mask[..., 0]
    douts = randn(n, length, heads, dv) * mask, randn(n, heads, dk, dv)
    keep = valid.nonzero(as_tuple=True)
    results = []
    for impl, io_dtype in ((TorchScanKernel(), torch.float64), (kernel, dtype)):
        leaves = [t.to(device, compute_dtype(io_dtype)).requires_grad_() for t in (q, k, v, g)]
        o, final = impl.run(*leaves, lengths=list(_CHECK_LENGTHS), chunk_size=16,
                            io_dtype=io_dtype)  # fmt: skip
        grads = torch.autograd.grad((o, final), leaves, [d.to(device, o.dtype) for d in douts])
        results.append([o[keep], final, *(grad[keep] for grad in grads)])
    names = ("o", "final state", "dq", "dk", "dv", "dg")
    note = f"; rows of lengths {_CHECK_LENGTHS}"
    return compare_results(names, results[1], results[0], _TOLERANCE[dtype], note)


# ------------------------------------------------------------------ choice
def select_scan_kernel(name: str, device, dtype, dk: int, dv: int, kernels=None) -> ScanKernel:
    """The kernel of a scan with activations of ``dtype`` on ``device`` and state
    [dk, dv] per head: the named one, or for ``auto`` fla where it can, else torch.
    ``kernels``: {"torch": ..., "fla": ...} (default usp's)."""
    kernels = DEFAULT if kernels is None else kernels
    return choose(
        name, ("torch", "fla"), kernels.__getitem__,
        lambda _, kernel: kernel.limits_reason(device, dtype, dk)
        or kernel.verdict(device, dtype, dk, dv),
        order=("fla", "torch"), kind="scan kernel",
        call=f"this call ({device.type}, {dtype}, dk={dk}, dv={dv})",
        log=logging.getLogger(__name__), unknown=ScanKernelError, unable=ScanKernelError,
        fix=lambda: "kernel='auto' or 'torch' runs it with usp's torch kernel",
    )  # fmt: skip

"""The kernels of the gated delta rule behind one seam: usp's torch kernel, and fla's
Triton kernel (``fla-core``: ``pip install 'usp[fla]'``) on CUDA.

The seam (:meth:`GdnKernel.run`) is what :mod:`usp.linear.gdn` calls on a rank's
segments: independent rows in the padded layout of
:func:`usp.linear.kernel.gated_delta_rule_padded` -- q, k [N, L, H, dk] (key heads already
expanded to value heads, l2-normalised and scaled), v [N, L, H, dv], g (log decay) and
beta [N, L, H], all in the compute dtype; row i holds ``lengths[i]`` tokens, zeros after
them -- and an optional initial state [N, H, dk, dv]. It returns (o [N, L, H, dv], the
final states [N, H, dk, dv]) in the compute dtype, differentiable in every input and in
the initial state (the ring's state pass needs both directions).

Choice (``kernel=`` of :func:`usp.linear.gated_deltanet_usp` and
:class:`usp.linear.GatedDeltaNet`): ``"auto"`` takes ``fla`` where it can run the call
(CUDA, float32/bfloat16/float16 activations, dk <= 256, fla importable) and passed its
self-check there, else ``torch``; ``"torch"`` or ``"fla"`` forces one, and a forced
kernel that cannot run is refused (:class:`GdnKernelError`) with the reason.

fla runs q, k, v and beta in the activations' dtype when that is bfloat16/float16 (the
dtypes transformers hands it), the decay and the states in float32, with ``scale=1``
(q comes scaled) and the rows packed into one ``cu_seqlens`` call (no work on padding).

Self-check: before fla serves its first call for a (device, dtype, dk, dv), a small call
through the same mapping -- rows of unequal lengths and an empty one, a non-zero initial
state, chunk size 16, forward and the backward of both outputs -- is compared with the
torch kernel in float64 on the same device. A kernel that raises or disagrees is refused
(a :class:`BackendFailure`): ``auto`` warns once and takes torch, a forced one raises.
None of this has run on a GPU yet (the GPU check's cases are in
tests/kernels/test_new_paths_device.py).
"""

from __future__ import annotations

import logging

import torch

from usp.errors import InputError
from usp.kernels.optional import Kernel, PackageKernel, compare_results
from usp.kernels.selection import choose
from usp.linear.fla_rows import run_packed
from usp.linear.kernel import compute_dtype, gated_delta_rule_padded
from usp.options import LINEAR_BACKENDS

__all__ = [
    "DEFAULT",
    "GDN_KERNELS",
    "FlaGdnKernel",
    "GdnKernel",
    "GdnKernelError",
    "GdnKernels",
    "TorchGdnKernel",
    "select_gdn_kernel",
]

#: the names ``kernel=`` takes (``auto`` picks one per call): ``[attention] linear_backend``'s
GDN_KERNELS: tuple[str, ...] = LINEAR_BACKENDS

# generous: catches wrong layouts, scales, states and gradients, not rounding (fla's
# float32 matmuls may run in tf32)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-2, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class GdnKernelError(InputError):
    """A gated delta rule kernel that is unknown or cannot run the call here."""


class GdnKernel(Kernel):
    """One implementation of the seam (see the module's docstring); its limits read the
    key head dim, its self-check (dk, dv)."""

    def run(self, q, k, v, g, beta, *, lengths, initial_state, chunk_size, io_dtype):
        raise NotImplementedError


class TorchGdnKernel(GdnKernel):
    """usp's chunked kernel in torch (any device and dtype; padding is exact for it)."""

    name = "torch"

    def run(self, q, k, v, g, beta, *, lengths, initial_state, chunk_size, io_dtype):
        return gated_delta_rule_padded(
            q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size
        )


class FlaGdnKernel(PackageKernel, GdnKernel):
    """fla's ``chunk_gated_delta_rule``, imported lazily from ``module`` (or the given
    ``function``, which takes fla's signature: tests hand in a stand-in). A Triton
    kernel: on CPU tensors under Triton's interpreter (:mod:`usp.kernels.optional`)."""

    name = "fla"
    attribute = "chunk_gated_delta_rule"
    install = "fla (pip install 'usp[fla]')"
    error = GdnKernelError
    interpretable = True

    def __init__(self, function=None, *, module="fla.ops.gated_delta_rule", max_key_dim=256,
                 **limits):  # fmt: skip
        """``max_key_dim``: fla's chunk kernels assert K <= 256; ``limits``: device_types,
        dtypes (:class:`PackageKernel`)."""
        super().__init__(function, module=module, **limits)
        self.max_key_dim = max_key_dim

    def own_limits(self, dk, dv=None):
        if dk > self.max_key_dim:
            return f"takes key head dims up to {self.max_key_dim}, not {dk}"
        return None

    def describe_shape(self, dk, dv):
        return [f"dk={dk}", f"dv={dv}"]

    def check(self, device, dtype, dk, dv):
        return _compare_with_torch(self, device, dtype, dk, dv)

    def run(self, q, k, v, g, beta, *, lengths, initial_state, chunk_size, io_dtype):
        compute = v.dtype
        low = io_dtype if io_dtype in (torch.bfloat16, torch.float16) else compute
        # the decay in float32 (float64 only off fla: stand-ins)
        inputs = [(q, low), (k, low), (v, low), (g, compute), (beta, low)]
        return run_packed(
            self.function(), inputs, compute=compute, lengths=lengths, initial_state=initial_state,
            state_shape=(q.shape[2], q.shape[3], v.shape[3]),
            scale=1.0, chunk_size=chunk_size if chunk_size in (16, 32, 64) else 64,
        )  # fmt: skip


# ------------------------------------------------------------------ self-check
_CHECK_LENGTHS = (40, 23, 0, 17)  # unequal rows, one empty, none a multiple of 16
_CHECK_HEADS = 2


def _check_inputs(device, dk, dv):
    """Random padded rows in float64 (zeros past each row's length) and gradients."""
    gen = torch.Generator().manual_seed(2024)
    n, length, heads = len(_CHECK_LENGTHS), max(_CHECK_LENGTHS), _CHECK_HEADS
    valid = torch.arange(length)[None, :] < torch.tensor(_CHECK_LENGTHS)[:, None]
    mask = valid[..., None].double()  # [N, L, 1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (randn(n, length, heads, dk) for _ in "qk")
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True)) * 0.6 * dk**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True))
    v = randn(n, length, heads, dv)
    g = -torch.rand(n, length, heads, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(n, length, heads, generator=gen, dtype=torch.float64)
    q, k, v = (t * mask[..., None] for t in (q, k, v))
    g, beta = g * mask, beta * mask
    state = randn(n, heads, dk, dv) * 0.3
    dout = randn(n, length, heads, dv) * mask[..., None]
    dstate = randn(n, heads, dk, dv)
    return [t.to(device) for t in (q, k, v, g, beta, state, dout, dstate, valid)]


def _outputs_and_grads(kernel, tensors, dtype):
    """o, the final states and the gradients of every input; the per-token ones only at
    valid tokens (the decay's gradient past a row's end is not defined by the seam: the
    caller's padding discards it)."""
    *inputs, dout, dstate, valid = tensors
    leaves = [t.to(compute_dtype(dtype)).requires_grad_() for t in inputs]
    o, final = kernel.run(
        *leaves[:5], lengths=list(_CHECK_LENGTHS), initial_state=leaves[5], chunk_size=16,
        io_dtype=dtype,
    )  # fmt: skip
    grads = torch.autograd.grad((o, final), leaves, (dout.to(o.dtype), dstate.to(final.dtype)))
    keep = valid.nonzero(as_tuple=True)
    return [o[keep], final, *(grad[keep] for grad in grads[:5]), grads[5]]


def _compare_with_torch(kernel, device, dtype, dk, dv) -> str | None:
    """A small call through ``kernel``'s mapping against the torch kernel in float64 on
    the same device: rows of unequal lengths and an empty one, a non-zero initial state,
    chunk size 16, forward and the backward of both outputs."""
    tensors = _check_inputs(device, dk, dv)
    expected = _outputs_and_grads(TorchGdnKernel(), tensors, torch.float64)
    actual = _outputs_and_grads(kernel, tensors, dtype)
    names = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    note = f"; rows of lengths {_CHECK_LENGTHS}, an initial state, chunk size 16"
    return compare_results(names, actual, expected, _TOLERANCE[dtype], note)


# ------------------------------------------------------------------ choice
class GdnKernels:
    """Kernel instances by name (``torch`` and ``fla``); tests hand in their own."""

    def __init__(self, torch_kernel: GdnKernel, fla_kernel: GdnKernel):
        self._kernels = {"torch": torch_kernel, "fla": fla_kernel}

    def get(self, name: str) -> GdnKernel:
        return self._kernels[name]


#: usp's kernels
DEFAULT = GdnKernels(TorchGdnKernel(), FlaGdnKernel())


def _reason(kernel: GdnKernel, device, dtype, dk, dv) -> str | None:
    return kernel.limits_reason(device, dtype, dk) or kernel.verdict(device, dtype, dk, dv)


def select_gdn_kernel(
    name: str, device: torch.device, dtype: torch.dtype, dk: int, dv: int, kernels=None
) -> GdnKernel:
    """The kernel that runs a call with activations of ``dtype`` on ``device`` and state
    [dk, dv] per head (dv includes the ring's d_k extra columns): the named one, or for
    ``auto`` fla where it can, else torch. Runs no kernel but fla's one-time self-check.
    Raises :class:`GdnKernelError` for an unknown name or a forced kernel that cannot run."""
    kernels = DEFAULT if kernels is None else kernels
    return choose(
        name, ("torch", "fla"), kernels.get,
        lambda _, kernel: _reason(kernel, device, dtype, dk, dv),
        order=("fla", "torch"), kind="GDN kernel",
        call=f"this call ({device.type}, {dtype}, dk={dk}, dv={dv})", log=logging.getLogger(__name__),
        unknown=GdnKernelError, unable=GdnKernelError,
        fix=lambda: "kernel='auto' or 'torch' runs it with usp's torch kernel",
    )  # fmt: skip

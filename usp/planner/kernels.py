"""The attention kernels a planned step runs under fake tensors.

Under ``FakeTensorMode`` no kernel computes anything: each aten op's fake (meta) kernel
only allocates its outputs, which is all the memory tracker needs. What must not run
there is the host-side vetting around the real backends: the one-time self-check
(it compares numbers), ``torch.cuda.get_device_capability`` (no GPU on the planning
machine) and the CPU backend's finiteness test (a host read of a tensor). So the planner
brings its own two backends, one per device type -- ``cudnn`` on CUDA, ``cpu`` on the
CPU, the kernels ``usp train`` picks first there -- which call the same aten ops with
the same layouts as :mod:`usp.kernels.backends.sdpa_cuda` and
:mod:`usp.kernels.backends.cpu` and nothing else. :func:`planning_kernels` makes a
kernel registry with them in place of those names, which the planned step's
:class:`usp.Plan` is given (``kernel_registry=``); usp's own registry is not touched.

Workspaces: a fake kernel allocates only its outputs, while the real ones allocate
working memory for the duration of a call (FA2's float32 ``dq_accum``, cuDNN's
``dQ_accum``, the CPU kernel's per-thread buffers). Under fake tensors each planning
backend allocates the workspace of the backend it stands for
(:func:`usp.planner.overheads.attention_workspace`) right before the op and frees it
right after, so the tracker counts it exactly where it is live; :class:`KernelLog` keeps
the largest (what the report shows). With real tensors (a step run for real to check
the planner) the real kernel allocates its own and nothing is added.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from usp.kernels.backends import registry
from usp.kernels.backends.base import Backend, Grads
from usp.kernels.masks import lse_for_backward
from usp.kernels.spec import BackendUnavailableError
from usp.planner.overheads import CPU_PACKING, CpuPacking, attention_workspace

#: what ``backend = "auto"`` runs for the trainer's packed calls (it always passes the
#: document boundaries): the first backend with native varlen kernels on CUDA (torch's
#: FA2), the CPU flash kernel on the CPU
AUTO_PACKED = {"cuda": "flash", "cpu": "cpu"}
_CUDA_NAMES = ("cudnn", "flash_attn", "flash", "efficient")


def cpu_packing(dtype: torch.dtype) -> CpuPacking | None:
    """Whether torch's CPU flash kernel may pack K and V for ``dtype`` on this machine
    (its oneDNN brgemm path; :class:`usp.planner.overheads.CpuPacking`): bf16 on a CPU
    with AMX-BF16; fp16 on one with AMX-FP16 (PyTorch's condition) or AVX512-FP16 (a
    Sapphire Rapids Xeon's fp16 forward was reported above the unpacked formula too: the
    planner takes the larger path there rather than be optimistic). Never with oneDNN
    off (``torch.backends.mkldnn.enabled = False``, which makes the kernel skip it)."""
    name = str(dtype).removeprefix("torch.")
    if name not in CPU_PACKING or not torch.backends.mkldnn.enabled:
        return None
    isa = torch._C._cpu._get_cpu_capability()
    flags = ("amx_bf16",) if name == "bfloat16" else ("amx_fp16", "avx512_fp16")
    return CPU_PACKING[name] if any(isa.get(flag) for flag in flags) else None


def planning_backend(device: str, configured: str) -> str:
    """The backend name a planned step (and its time estimate) uses: the configured one,
    or for ``"auto"`` the one auto would pick for the trainer's calls."""
    if configured == "auto":
        return AUTO_PACKED[device]
    if device == "cpu" and configured in _CUDA_NAMES:
        raise BackendUnavailableError(
            f"[attention] backend = {configured!r} runs on CUDA only; plan with --device cuda "
            'or set backend = "auto" or "cpu"'
        )
    return configured


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D] (a view)


@dataclass
class KernelLog:
    """The largest workspace one planned attention call allocated: bytes, and the call."""

    workspace: int = 0
    call: str = ""

    def note(self, nbytes: int, call: str) -> None:
        if nbytes > self.workspace:
            self.workspace, self.call = nbytes, call


class _Planning(Backend):
    """What every planning backend shares: the workspace of the backend it stands for,
    noted in ``log``. ``name``: the backend it stands for; it takes the calls that one
    takes."""

    def __init__(self, name: str, log: KernelLog):
        self.name = name
        self.log = log
        # sliding windows (Gemma 3) where the real backend takes them (FA2's
        # window_size_left, the CPU kernel's mask), with the same outputs and workspaces:
        # a windowed call is planned as its dense call, the full causal block, whose
        # tensors have the same shapes (memory only: no number is used, none under-counted)
        self.supports_window = registry.get(name).supports_window

    def _workspace(self, q: torch.Tensor, spec, *, backward: bool) -> torch.Tensor | None:
        """The real kernel's working memory for this call, as one fake tensor (None with
        real tensors, whose kernel allocates its own)."""
        if not isinstance(q, FakeTensor):
            return None
        nbytes = attention_workspace(
            self.name, batch=spec.batch, seqlen_q=spec.seqlen_q, seqlen_k=spec.seqlen_k,
            heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            item_bytes=q.element_size(), backward=backward, threads=os.cpu_count() or 1,
            cpu_packing=cpu_packing(q.dtype),
        )  # fmt: skip
        kind = "backward" if backward else "forward"
        self.log.note(
            nbytes,
            f"{self.name} {kind}, q [{spec.batch}, {spec.seqlen_q}, {spec.num_heads}, "
            f"{spec.head_dim}], k/v [{spec.batch}, {spec.seqlen_k}, {spec.num_kv_heads}, "
            f"{spec.head_dim}] {str(q.dtype).removeprefix('torch.')}",
        )
        return torch.empty(nbytes, dtype=torch.uint8, device=q.device) if nbytes else None


class _FakeCuda(_Planning):
    """cuDNN attention's ops (``_scaled_dot_product_cudnn_attention`` and its backward)
    on contiguous BSHD tensors, as ``sdpa_cuda.CudnnBackend`` calls them. It stands for
    every CUDA backend: they all return out in the input's dtype and an fp32 LSE of one
    value per row, and take the same tensors back. On the CPU stand-in device (a torch
    without CUDA) the ops' fake kernels run on CPU fake tensors."""

    device_types = ("cuda", "cpu")
    self_checked = False
    min_seqlen_k = 2

    def forward(self, q, k, v, spec, scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        workspace = self._workspace(q, spec, backward=False)  # noqa: F841 (live in the op)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, spec.causal, False, scale=scale
        )[:2]
        del workspace
        return _bhsd(out), lse.reshape(spec.batch, spec.num_heads, spec.seqlen_q)

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
        kernel_lse = lse_for_backward(lse).contiguous().unsqueeze(-1)  # [B, H, S, 1]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        workspace = self._workspace(q, spec, backward=True)  # noqa: F841 (live in the op)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), kernel_lse, seed, offset,
            None, None, None, spec.seqlen_q, spec.seqlen_k, 0.0, spec.causal, scale=scale,
        )  # fmt: skip
        del workspace
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


class _FakeCpu(_Planning):
    """The CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) without the
    real backend's finiteness detour (which reads a value on the host)."""

    device_types = ("cpu",)
    self_checked = False
    bottom_right_causal = False

    def forward(self, q, k, v, spec, scale):
        workspace = self._workspace(q, spec, backward=False)  # noqa: F841 (live in the op)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, spec.causal, scale=scale
        )
        del workspace
        return _bhsd(out), lse

    def backward(self, dout, q, k, v, out, lse, spec, scale) -> Grads:
        kernel_lse = lse_for_backward(lse).contiguous()
        workspace = self._workspace(q, spec, backward=True)  # noqa: F841 (live in the op)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), kernel_lse, 0.0,
            spec.causal, scale=scale,
        )  # fmt: skip
        del workspace
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def planning_kernels() -> tuple[registry.KernelRegistry, KernelLog]:
    """A kernel registry serving the planning backends for the CUDA names and ``cpu``
    (``math`` as usp's), and the :class:`KernelLog` of their workspaces. A planned step
    makes its own: nothing is shared between steps."""
    log = KernelLog()
    planning = {"cpu": _FakeCpu("cpu", log), **{n: _FakeCuda(n, log) for n in _CUDA_NAMES}}
    return registry.DEFAULT.replacing(planning), log

"""The peers of ``benchmarks/peers.py`` as runnable cases: what one row runs on rank 0.

:class:`Setup` (shared by every row), :class:`Peer` (one row), and per peer a context
manager ``CASES[name](peer, setup)`` that yields a :class:`Case` (forward, backward and
notes) inside a ``fake`` world, or raises :class:`PeerUnavailable` with the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import usp
from benchmarks import emulate

PEERS = ("usp", "torch-cp", "torch-cp-ring", "ring-flash-attn", "yunchang")
MB = 1e6


class PeerUnavailable(Exception):
    """This peer cannot run in this environment; the message says why."""


# ------------------------------------------------------------------ what runs
@dataclass(frozen=True)
class Setup:
    """Shared by every row: one sequence of ``seqlen`` tokens on ``sp`` ranks."""

    preset: str
    seqlen: int
    sp: int
    dtype: str
    batch: int
    ranks_per_node: int
    device: torch.device
    warmup: int
    repeats: int
    monolithic_repeats: int
    max_monolithic_tokens: int

    def __post_init__(self):
        if self.seqlen % (2 * self.sp):
            raise ValueError(
                f"seqlen {self.seqlen} must be a multiple of 2 * sp = {2 * self.sp}: every "
                "peer cuts the sequence into 2 * sp chunks (zigzag / head-tail)"
            )

    @property
    def shape(self):
        return emulate.PRESETS[self.preset]

    @property
    def torch_dtype(self) -> torch.dtype:
        return emulate.DTYPES[self.dtype]

    @property
    def local_len(self) -> int:
        return self.seqlen // self.sp


@dataclass(frozen=True)
class Peer:
    """One row: ``variant`` is usp's ring implementation, torch's rotate method or
    "zigzag"; ``kernel`` is the local attention (usp backend, SDPA backend, flash-attn)."""

    name: str
    ulysses: int
    ring: int
    variant: str
    kernel: str

    @property
    def reference(self) -> str:
        """The kernel class of the monolithic reference."""
        if self.name == "usp":
            return f"usp:{self.kernel}"
        if self.name in ("torch-cp", "torch-cp-ring"):
            return f"sdpa:{self.kernel}"
        return "flash-attn"

    def label(self) -> str:
        return f"{self.name} {self.ulysses}x{self.ring} {self.variant} {self.kernel}"


@dataclass
class Case:
    """A peer ready to run on this rank: ``forward()`` -> output, ``backward(output)``."""

    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], object]
    notes: list[str] = field(default_factory=list)
    comm_stats: usp.comm.stats.CommStats | None = None


def _randn(shape, setup: Setup, grad: bool = False) -> torch.Tensor:
    t = torch.randn(shape, device=setup.device, dtype=setup.torch_dtype)
    return t.requires_grad_(grad)


def bshd_inputs(setup: Setup, seqlen: int) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dout in the flash-attn layout [B, S, H, D]."""
    s = setup.shape
    q_shape = (setup.batch, seqlen, s.heads, s.head_dim)
    kv_shape = (setup.batch, seqlen, s.kv_heads, s.head_dim)
    q, k, v = (_randn(shape, setup, True) for shape in (q_shape, kv_shape, kv_shape))
    return [q, k, v, _randn(q_shape, setup)]


def bhsd_inputs(setup: Setup, seqlen: int) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dout in the SDPA layout [B, H, S, D]."""
    return [
        t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
        for t in bshd_inputs(setup, seqlen)
    ]


def grads_of(inputs: list[torch.Tensor], dout: torch.Tensor):
    return lambda out: torch.autograd.grad(out, inputs, dout)


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D], as a Llama model does before SDPA."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


# ------------------------------------------------------------------ the peers
@contextmanager
def usp_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    topo = usp.build_topology(
        peer.ulysses,
        peer.ring,
        ranks_per_node=setup.ranks_per_node,
        device_type=setup.device.type,
    )
    try:
        q, k, v, dout = bshd_inputs(setup, setup.local_len)  # [B, S/P, H(kv), D]

        def forward():
            return usp.usp_attention(
                q,
                k,
                v,
                topo,
                causal=True,
                layout="zigzag",
                ring_impl=peer.variant if peer.ring > 1 else "p2p",
                backend=peer.kernel,
            )

        notes = ["usp_attention, zigzag layout; K/V heads replicated only where u needs it"]
        yield Case(forward, grads_of([q, k, v], dout), notes, topo.comm_stats)
    finally:
        topo.destroy()


def sdpa_backend(kernel: str):
    from torch.nn.attention import SDPBackend

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    if kernel not in backends:
        raise ValueError(f"unknown SDPA backend {kernel!r}; valid: {', '.join(backends)}")
    return backends[kernel]


GQA_NOTE = (
    "K/V expanded from {kv} to {h} heads before SDPA (repeat_interleave, as torchtitan's "
    "Llama does), inside the timed forward: torch CP rotates the expanded K/V"
)


@contextmanager
def torch_cp_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    """``context_parallel`` around ``F.scaled_dot_product_attention``, the public API."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backend(peer.kernel)
    s = setup.shape
    groups = s.heads // s.kv_heads
    mesh = init_device_mesh(setup.device.type, (setup.sp,), mesh_dim_names=("cp",))
    # whole-sequence buffers, as a torch CP user passes them; sharded in place on entry
    q, k, v, dout = (t.detach() for t in bhsd_inputs(setup, setup.seqlen))
    buffers = [q, k, v, dout]
    set_rotate_method = _torch_cp_internals().set_rotate_method  # public, in a private module
    set_rotate_method(peer.variant)
    try:
        with context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)
        ):
            # this rank's head-tail shard, [B, H(kv), S/P, D]; free the whole-sequence
            # storage (resize_ keeps it) so peak memory counts what one rank holds
            ql, kl, vl, doutl = (b.clone() for b in buffers)
            for b in buffers:
                b.set_()
            for t in (ql, kl, vl):
                t.requires_grad_()

            def forward():
                with sdpa_kernel(backend):
                    kx, vx = expand_kv(kl, groups), expand_kv(vl, groups)
                    return F.scaled_dot_product_attention(ql, kx, vx, is_causal=True)

            if setup.device.type == "cpu":  # expected to fail; a torch that can, runs
                try:
                    forward()
                except Exception as err:
                    raise PeerUnavailable(
                        "context_parallel's SDPA dispatch has no CPU kernel (it handles "
                        f"torch's CUDA flash/efficient/cuDNN ops only): {first_line(err)}"
                    ) from None
            notes = [GQA_NOTE.format(kv=s.kv_heads, h=s.heads)]
            yield Case(forward, grads_of([ql, kl, vl], doutl), notes)
    finally:
        set_rotate_method("allgather")  # torch's default; the option is global


def _torch_cp_internals():
    """The module holding torch CP's ring functions and options: a package from torch
    2.10 on (``_attention`` re-exports only part of it), a single module before."""
    try:
        return importlib.import_module(
            "torch.distributed.tensor.experimental._context_parallel._attention"
        )
    except ImportError:
        return importlib.import_module("torch.distributed.tensor.experimental._attention")


class _TorchRingCore(torch.autograd.Function):
    """torch CP's ring (the functions its SDPA dispatch calls) with the CPU flash kernel.
    q, k, v [B, H, S/P, D] in head-tail order -> out [B, H, S/P, D]."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = _torch_cp_internals()._templated_ring_attention(
            group,
            2,  # seq dim
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            q,
            k,
            v,
            is_causal=True,
            dropout_p=0.0,
            scale=None,
        )[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _torch_cp_internals()._templated_ring_attention_backward(
            ctx.group,
            2,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=dout.contiguous(),
            grad_out_name="grad_out",
            query=q,
            key=k,
            value=v,
            out=out,
            logsumexp=lse,
            is_causal=True,
            dropout_p=0.0,
            scale=None,
        )[:3]
        return dq, dk, dv, None


@contextmanager
def torch_ring_options(rotate: str) -> Iterator[None]:
    """Head-tail load balancing on (as ``context_parallel`` sets it for a causal sequence
    of 2P chunks) and the rotate method, restored afterwards (both are torch globals)."""
    internals = _torch_cp_internals()
    options = internals._cp_options
    balance = options.enable_load_balance
    options.enable_load_balance = True
    internals.set_rotate_method(rotate)
    try:
        yield
    finally:
        options.enable_load_balance = balance
        internals.set_rotate_method("allgather")


def torch_ring_attention(q, k, v, group) -> torch.Tensor:
    """Differentiable torch CP ring core on CPU (call inside ``torch_ring_options``)."""
    return _TorchRingCore.apply(q, k, v, group)


@contextmanager
def torch_cp_ring_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    if setup.device.type != "cpu":
        raise PeerUnavailable(
            "the ring-core stand-in drives the CPU flash kernel; on CUDA the torch-cp row "
            "runs context_parallel itself"
        )
    if peer.kernel != "flash":
        raise PeerUnavailable(f"the CPU ring core uses the CPU flash kernel, not {peer.kernel}")
    s = setup.shape
    groups = s.heads // s.kv_heads
    q, k, v, dout = bhsd_inputs(setup, setup.local_len)  # [B, H(kv), S/P, D]
    group = dist.group.WORLD

    def forward():
        return torch_ring_attention(q, expand_kv(k, groups), expand_kv(v, groups), group)

    notes = [
        "CPU stand-in for torch-cp: torch's private _templated_ring_attention forward and "
        "backward (what context_parallel's SDPA dispatch calls: same head-tail balancing, "
        "rotation and LSE merge) with the CPU flash kernel; DTensor dispatch not included",
        GQA_NOTE.format(kv=s.kv_heads, h=s.heads),
    ]
    with torch_ring_options(peer.variant):
        yield Case(forward, grads_of([q, k, v], dout), notes)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def import_optional(module: str, purpose: str):
    try:
        return importlib.import_module(module)
    except Exception as err:  # ImportError, or a broken install raising anything else
        raise PeerUnavailable(f"{purpose} does not import: {first_line(err)}") from None


def _require_cuda(setup: Setup, who: str) -> None:
    if setup.device.type != "cuda":
        raise PeerUnavailable(f"{who} runs flash-attn kernels, which need CUDA")


@contextmanager
def ring_flash_attn_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    rfa = import_optional(
        "ring_flash_attn", "ring_flash_attn (pip install ring-flash-attn flash-attn)"
    )
    _require_cuda(setup, "ring-flash-attn")
    q, k, v, dout = bshd_inputs(setup, setup.local_len)  # [B, S/P, H(kv), D], zigzag order

    def forward():
        return rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=dist.group.WORLD)

    notes = ["zigzag_ring_flash_attn_func; flash-attn handles GQA (K/V not expanded)"]
    yield Case(forward, grads_of([q, k, v], dout), notes)


@contextmanager
def yunchang_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    yunchang = import_optional("yunchang", "yunchang (pip install yunchang)")
    import_optional(
        "flash_attn",
        "flash-attn, which yunchang's LongContextAttention needs for a backward (its torch "
        "attention types raise 'Not implemented backward for PyTorch attention types'),",
    )
    _require_cuda(setup, "yunchang")
    s, u = setup.shape, peer.ulysses
    if s.heads % u or s.kv_heads % u:
        raise PeerUnavailable(
            f"yunchang's all-to-all splits heads evenly: heads {s.heads} and kv_heads "
            f"{s.kv_heads} must both be multiples of ulysses {u} (usp replicates K/V heads)"
        )
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType

    # ulysses groups of consecutive ranks, rings strided: usp's ulysses-in-node placement
    yunchang.set_seq_parallel_pg(u, peer.ring, dist.get_rank(), dist.get_world_size())
    try:
        attn = yunchang.LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.FA)
        q, k, v, dout = bshd_inputs(setup, setup.local_len)

        def forward():
            return attn(q, k, v, causal=True)

        notes = ["LongContextAttention(ring_impl_type='zigzag', attn_type=FA)"]
        yield Case(forward, grads_of([q, k, v], dout), notes)
    finally:  # yunchang keeps its groups in a module-level singleton
        PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = None


CASES = {
    "usp": usp_case,
    "torch-cp": torch_cp_case,
    "torch-cp-ring": torch_cp_ring_case,
    "ring-flash-attn": ring_flash_attn_case,
    "yunchang": yunchang_case,
}

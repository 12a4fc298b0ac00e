"""usp next to its peers: one rank of the same sequence-parallel attention job, side by side.

    python benchmarks/peers.py [--out results/]                 # the default comparison
    python benchmarks/peers.py --seqlen 262144 --sp 8 --grids 1x8 2x4 --out results/

In one process, under PyTorch's ``fake`` process group (``emulate.fake_world``: this
process is rank 0 of a world of P ranks, collectives return at once), each peer runs the
forward and backward of causal attention on the same shapes and the same tokens per rank:

- ``usp``: ``usp.usp_attention`` (zigzag layout) on every requested (ulysses, ring) grid.
- ``torch-cp``: PyTorch's native context parallel, ``context_parallel(mesh, buffers=...)``
  around ``F.scaled_dot_product_attention`` (its SDPA ring, head-tail load balancing =
  zigzag), for every SDPA backend and rotate method (``set_rotate_method``) asked for.
  Its dispatch has no CPU kernel; on CPU the row says so and is skipped.
- ``torch-cp-ring`` (CPU only): the ring ``context_parallel`` dispatches to, torch's
  private ``_templated_ring_attention`` forward and backward, driven directly with the
  CPU flash kernel: the same algorithm, balancing, rotation and merge, without the
  DTensor dispatch. It is what can run of torch CP on CPU.
- ``ring-flash-attn``: ``ring_flash_attn.zigzag_ring_flash_attn_func`` (needs flash-attn,
  so CUDA).
- ``yunchang``: ``LongContextAttention(ring_impl_type="zigzag", attn_type=FA)`` on every
  grid (needs flash-attn for a backward, so CUDA).

A peer that cannot run here gives a row marked ``skipped`` with the reason; a peer that
raises gives a row marked ``failed`` with the error, and the script exits non-zero.

Per row: forward + backward time of the rank (median of ``--repeats`` after
``--warmup``), efficiency = (monolithic / P) / per-rank time, where monolithic is one
attention call over the whole sequence with the same kernel class (usp: the same usp
backend; torch: the same SDPA backend, K/V expanded the same way; ring-flash-attn and
yunchang: ``flash_attn_func``); peak memory (CUDA only); and the bytes this rank sends,
counted for every peer alike by intercepting the collectives it issues (a
``TorchDispatchMode`` over the ``c10d`` and functional-collective ops), with usp's own
``Topology.comm_stats`` next to it as a check.

Nothing here measures real communication: see ``emulate.py`` and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import usp
from usp.kernels import BackendUnavailableError


def _sibling(name: str):
    """``benchmarks/<name>.py`` under the module name the tests load it by."""
    module_name = f"usp_benchmarks_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            module_name, Path(__file__).with_name(f"{name}.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[module_name]


emulate = _sibling("emulate")

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
    comm_stats: usp.CommStats | None = None


def _randn(shape, setup: Setup, grad: bool = False) -> torch.Tensor:
    t = torch.randn(shape, device=setup.device, dtype=setup.torch_dtype)
    return t.requires_grad_(grad)


def _bshd_inputs(setup: Setup, seqlen: int) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dout in the flash-attn layout [B, S, H, D]."""
    s = setup.shape
    q_shape = (setup.batch, seqlen, s.heads, s.head_dim)
    kv_shape = (setup.batch, seqlen, s.kv_heads, s.head_dim)
    q, k, v = (_randn(shape, setup, True) for shape in (q_shape, kv_shape, kv_shape))
    return [q, k, v, _randn(q_shape, setup)]


def _bhsd_inputs(setup: Setup, seqlen: int) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dout in the SDPA layout [B, H, S, D]."""
    return [
        t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
        for t in _bshd_inputs(setup, seqlen)
    ]


def _grads_of(inputs: list[torch.Tensor], dout: torch.Tensor):
    return lambda out: torch.autograd.grad(out, inputs, dout)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
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
        q, k, v, dout = _bshd_inputs(setup, setup.local_len)  # [B, S/P, H(kv), D]

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
        yield Case(forward, _grads_of([q, k, v], dout), notes, topo.comm_stats)
    finally:
        topo.destroy()


def _sdpa_backend(kernel: str):
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

    backend = _sdpa_backend(peer.kernel)
    s = setup.shape
    groups = s.heads // s.kv_heads
    mesh = init_device_mesh(setup.device.type, (setup.sp,), mesh_dim_names=("cp",))
    # whole-sequence buffers, as a torch CP user passes them; sharded in place on entry
    q, k, v, dout = (t.detach() for t in _bhsd_inputs(setup, setup.seqlen))
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
                    kx, vx = _expand_kv(kl, groups), _expand_kv(vl, groups)
                    return F.scaled_dot_product_attention(ql, kx, vx, is_causal=True)

            if setup.device.type == "cpu":  # expected to fail; a torch that can, runs
                try:
                    forward()
                except Exception as err:
                    raise PeerUnavailable(
                        "context_parallel's SDPA dispatch has no CPU kernel (it handles "
                        f"torch's CUDA flash/efficient/cuDNN ops only): {_first_line(err)}"
                    ) from None
            notes = [GQA_NOTE.format(kv=s.kv_heads, h=s.heads)]
            yield Case(forward, _grads_of([ql, kl, vl], doutl), notes)
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
    q, k, v, dout = _bhsd_inputs(setup, setup.local_len)  # [B, H(kv), S/P, D]
    group = dist.group.WORLD

    def forward():
        return torch_ring_attention(q, _expand_kv(k, groups), _expand_kv(v, groups), group)

    notes = [
        "CPU stand-in for torch-cp: torch's private _templated_ring_attention forward and "
        "backward (what context_parallel's SDPA dispatch calls: same head-tail balancing, "
        "rotation and LSE merge) with the CPU flash kernel; DTensor dispatch not included",
        GQA_NOTE.format(kv=s.kv_heads, h=s.heads),
    ]
    with torch_ring_options(peer.variant):
        yield Case(forward, _grads_of([q, k, v], dout), notes)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _import(module: str, purpose: str):
    try:
        return importlib.import_module(module)
    except Exception as err:  # ImportError, or a broken install raising anything else
        raise PeerUnavailable(f"{purpose} does not import: {_first_line(err)}") from None


def _require_cuda(setup: Setup, who: str) -> None:
    if setup.device.type != "cuda":
        raise PeerUnavailable(f"{who} runs flash-attn kernels, which need CUDA")


@contextmanager
def ring_flash_attn_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    rfa = _import("ring_flash_attn", "ring_flash_attn (pip install ring-flash-attn flash-attn)")
    _require_cuda(setup, "ring-flash-attn")
    q, k, v, dout = _bshd_inputs(setup, setup.local_len)  # [B, S/P, H(kv), D], zigzag order

    def forward():
        return rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=dist.group.WORLD)

    notes = ["zigzag_ring_flash_attn_func; flash-attn handles GQA (K/V not expanded)"]
    yield Case(forward, _grads_of([q, k, v], dout), notes)


@contextmanager
def yunchang_case(peer: Peer, setup: Setup) -> Iterator[Case]:
    yunchang = _import("yunchang", "yunchang (pip install yunchang)")
    _import(
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
        q, k, v, dout = _bshd_inputs(setup, setup.local_len)

        def forward():
            return attn(q, k, v, causal=True)

        notes = ["LongContextAttention(ring_impl_type='zigzag', attn_type=FA)"]
        yield Case(forward, _grads_of([q, k, v], dout), notes)
    finally:  # yunchang keeps its groups in a module-level singleton
        PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = None


CASES = {
    "usp": usp_case,
    "torch-cp": torch_cp_case,
    "torch-cp-ring": torch_cp_ring_case,
    "ring-flash-attn": ring_flash_attn_case,
    "yunchang": yunchang_case,
}


# ------------------------------------------------------------------ bytes on the wire
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(arg) -> dist.ProcessGroup:
    """The process group of a c10d op argument (boxed) or a functional op's group name."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(arg)
    return dist.ProcessGroup.unbox(arg)


def _split_bytes(t: torch.Tensor, splits, rank: int, size: int) -> int:
    """Bytes of an all-to-all buffer (split along dim 0) that go to or come from others."""
    total = _nbytes(t)
    if not splits:
        return total * (size - 1) // size
    row = total // t.shape[0] if t.shape[0] else 0
    return sum(n for j, n in enumerate(splits) if j != rank) * row


def _all_to_all_bytes(output, inp, out_splits, in_splits, group) -> tuple[int, int]:
    rank, size = group.rank(), group.size()
    return (
        _split_bytes(inp, in_splits, rank, size),
        _split_bytes(output, out_splits, rank, size),
    )


def _collective_traffic(op: str, args: tuple, result) -> tuple[str, int, int, int] | None:
    """(kind, sent, received, calls) of one collective op, in the convention of
    ``usp.CommStats``: the part a rank keeps is not counted; an all-gather sends the local
    block to each of the other ranks; a reduce-scatter sends all but the kept slice; an
    all-reduce counts a ring's 2 (n - 1) / n; a receive counts no call. None: not traffic."""
    if op == "send":
        return "p2p", sum(_nbytes(t) for t in args[0]), 0, 1
    if op == "recv_":
        return "p2p", 0, sum(_nbytes(t) for t in args[0]), 0
    if op == "alltoall_base_":
        output, inp, pg, out_splits, in_splits = args[:5]
        return "all_to_all", *_all_to_all_bytes(output, inp, out_splits, in_splits, _group(pg)), 1
    if op == "all_to_all_single":  # functional: (input, out splits, in splits, group name)
        inp, out_splits, in_splits, name = args[:4]
        return "all_to_all", *_all_to_all_bytes(result, inp, out_splits, in_splits, _group(name)), 1
    if op == "alltoall_":
        outputs, inputs, pg = args[:3]
        rank = _group(pg).rank()
        sent = sum(_nbytes(t) for j, t in enumerate(inputs) if j != rank)
        received = sum(_nbytes(t) for j, t in enumerate(outputs) if j != rank)
        return "all_to_all", sent, received, 1
    if op in (
        "_allgather_base_",
        "all_gather_into_tensor",
        "allgather_",
        "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor_coalesced",
    ):
        inputs = _tensors(args[1] if op.endswith("_") else args[0])
        size = _group(args[2]).size() if op.endswith("_") else int(args[1])
        moved = (size - 1) * sum(_nbytes(t) for t in inputs)
        return "all_gather", moved, moved, 1
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        outputs = _tensors(args[0])
        size = _group(args[2]).size()
        moved = (size - 1) * sum(_nbytes(t) for t in outputs)
        return "reduce_scatter", moved, moved, 1
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        size = int(args[2])
        moved = sum(_nbytes(t) for t in _tensors(args[0])) * (size - 1) // size
        return "reduce_scatter", moved, moved, 1
    if op in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
        size = _group(args[1] if op.endswith("_") else args[2]).size()
        moved = 2 * (size - 1) * sum(_nbytes(t) for t in _tensors(args[0])) // size
        return "all_reduce", moved, moved, 1
    return None


def _tensors(arg) -> list[torch.Tensor]:
    """Flatten a tensor, a list of tensors or a list of lists of tensors."""
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [t for item in arg for t in _tensors(item)]


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_TRAFFIC = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}


class CollectiveCounter(TorchDispatchMode):
    """Counts the bytes of every collective issued while active, per kind, like
    ``CommStats.snapshot()``; collectives it cannot size are listed in ``unrecognised``.

    Tensor subclasses (DTensor, AsyncCollectiveTensor) run first, so the collectives
    they issue underneath are seen as plain-tensor ops."""

    def __init__(self):
        super().__init__()
        self.traffic: dict[str, dict[str, int]] = {}
        self.unrecognised: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plain = torch.Tensor.__torch_dispatch__
        if any(getattr(t, "__torch_dispatch__", plain) is not plain for t in types):
            return NotImplemented
        result = func(*args, **(kwargs or {}))
        schema = getattr(func, "_schema", None)  # higher-order operators have none
        namespace, _, op = schema.name.partition("::") if schema else ("", "", "")
        if namespace in COLLECTIVE_NAMESPACES and op not in NOT_TRAFFIC:
            counted = _collective_traffic(op, args, result)
            if counted is None:
                self.unrecognised.add(schema.name)
            else:
                kind, sent, received, calls = counted
                entry = self.traffic.setdefault(kind, {"sent": 0, "received": 0, "calls": 0})
                entry["sent"] += sent
                entry["received"] += received
                entry["calls"] += calls
        return result


def count_passes(case: Case) -> dict:
    """One forward and one backward, each under a ``CollectiveCounter`` (and usp's stats)."""
    traffic, stats, unrecognised = {}, {}, set()
    out = None
    for phase in ("forward", "backward"):
        if case.comm_stats is not None:
            case.comm_stats.reset()
        with CollectiveCounter() as counter:
            if phase == "forward":
                out = case.forward()
            else:
                case.backward(out)
        traffic[phase] = counter.traffic
        unrecognised |= counter.unrecognised
        if case.comm_stats is not None:
            stats[phase] = case.comm_stats.snapshot()
    return {
        "traffic": traffic,
        "comm_stats": stats or None,
        "unrecognised_collectives": sorted(unrecognised),
    }


def total_sent(traffic: dict) -> int:
    return sum(c["sent"] for kinds in traffic.values() for c in kinds.values())


# ------------------------------------------------------------------ measuring
def measure(peer: Peer, setup: Setup) -> dict:
    """Run one peer as rank 0 of a fake world of ``setup.sp`` ranks."""
    with emulate.fake_world(setup.sp, 0, setup.device), CASES[peer.name](peer, setup) as case:
        times = emulate.time_passes(
            case.forward,
            case.backward,
            warmup=setup.warmup,
            repeats=setup.repeats,
            device=setup.device,
        )
        counted = count_passes(case)
        peak = emulate.peak_memory(lambda: case.backward(case.forward()), setup.device)
    return {
        "fwd_ms": times["forward"] * 1e3,
        "bwd_ms": times["backward"] * 1e3,
        "fwd_bwd_ms": times["forward_backward"] * 1e3,
        "peak_mem_bytes": peak,
        **counted,
        "notes": case.notes,
    }


def monolithic_passes(reference: str, setup: Setup, seqlen: int):
    """(forward, backward) of one attention call over ``seqlen`` tokens of the kernel class
    ``reference`` ("usp:<backend>", "sdpa:<backend>" or "flash-attn")."""
    s = setup.shape
    family, _, kernel = reference.partition(":")
    if family == "usp":
        q, k, v, dout = (t.detach() for t in _bshd_inputs(setup, seqlen))

        def forward():
            return usp.kernels.attention_forward(q, k, v, causal=True, backend=kernel)

        def backward(out_lse):
            out, lse = out_lse
            return usp.kernels.attention_backward(
                dout, q, k, v, out, lse, causal=True, backend=kernel
            )

        return forward, backward
    if family == "sdpa":
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(kernel)
        q, k, v, dout = _bhsd_inputs(setup, seqlen)
        groups = s.heads // s.kv_heads

        def forward():
            with sdpa_kernel(backend):
                kx, vx = _expand_kv(k, groups), _expand_kv(v, groups)
                return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

        return forward, _grads_of([q, k, v], dout)
    if family == "flash-attn":
        flash_attn = _import("flash_attn", "flash-attn")
        q, k, v, dout = _bshd_inputs(setup, seqlen)
        return lambda: flash_attn.flash_attn_func(q, k, v, causal=True), _grads_of([q, k, v], dout)
    raise ValueError(f"unknown reference kernel {reference!r}")


def monolithic(reference: str, setup: Setup) -> dict:
    """Monolithic forward + backward time for the whole sequence: measured at the full
    length, or at the largest power-of-two fraction within ``max_monolithic_tokens`` (and
    memory) and scaled by (S / measured)^2 (attention FLOPs are quadratic in S)."""
    measured = setup.seqlen
    while measured > setup.max_monolithic_tokens and measured % 2 == 0:
        measured //= 2
    while True:
        try:
            forward, backward = monolithic_passes(reference, setup, measured)
            seconds = emulate.time_passes(
                forward,
                backward,
                warmup=1,
                repeats=setup.monolithic_repeats,
                device=setup.device,
            )["forward_backward"]
            break
        except torch.cuda.OutOfMemoryError:
            if measured % 2 or measured <= 1024:
                raise
            measured //= 2
            torch.cuda.empty_cache()
        except (PeerUnavailable, BackendUnavailableError) as err:
            return {"reference": reference, "ms": None, "note": f"{reference}: {err}"}
        except Exception as err:
            traceback.print_exc()
            note = f"{reference} failed: {_first_line(err)}"
            return {"reference": reference, "ms": None, "note": note, "failed": True}
    scale = (setup.seqlen / measured) ** 2
    where = (
        f"at full length {measured}"
        if measured == setup.seqlen
        else f"at {measured} tokens, scaled x{scale:g} (quadratic)"
    )
    return {"reference": reference, "ms": seconds * scale * 1e3, "note": f"{reference} {where}"}


def run_peer(peer: Peer, setup: Setup, references: dict) -> dict:
    """One row: measured, skipped (with the reason) or failed (with the error)."""
    row = {**asdict(peer), "label": peer.label(), "rank": 0, "status": "ok", "reason": None}
    try:
        row.update(measure(peer, setup))
    except PeerUnavailable as err:
        row.update(status="skipped", reason=str(err))
        return row
    except Exception as err:
        traceback.print_exc()
        row.update(status="failed", reason=_first_line(err))
        return row
    finally:
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    if peer.reference not in references:
        references[peer.reference] = monolithic(peer.reference, setup)
    ref = references[peer.reference]
    s = setup.shape
    flops = emulate.attention_flops(setup.batch, setup.seqlen, s.heads, s.head_dim, True)
    ideal = None if ref["ms"] is None else ref["ms"] / setup.sp
    row.update(
        monolithic_ms=ref["ms"],
        monolithic_note=ref["note"],
        ideal_ms=ideal,
        efficiency=None if ideal is None else ideal / row["fwd_bwd_ms"],
        tflops_per_rank=flops / setup.sp / (row["fwd_bwd_ms"] / 1e3) / 1e12,
        bytes_sent=total_sent(row["traffic"]),
    )
    if row["comm_stats"] is not None:
        row["comm_stats_agree"] = row["comm_stats"] == row["traffic"]
    if ref.get("failed"):  # the row ran, but its efficiency cannot be trusted: say so loudly
        row.update(status="failed", reason=f"monolithic reference: {ref['note']}")
    return row


# ------------------------------------------------------------------ which rows
def ring_peers(args, sp: int) -> list[Peer]:
    """The peers that only know a ring: one ring of all P ranks."""
    rows = []
    if "torch-cp" in args.peers:
        for kernel in args.torch_backends:
            rows += [Peer("torch-cp", 1, sp, rotate, kernel) for rotate in args.torch_rotates]
    if "torch-cp-ring" in args.peers:
        rows += [Peer("torch-cp-ring", 1, sp, rotate, "flash") for rotate in args.torch_rotates]
    if "ring-flash-attn" in args.peers:
        rows.append(Peer("ring-flash-attn", 1, sp, "zigzag", "flash-attn"))
    return rows


def peers_of(args, sp: int) -> list[Peer]:
    """usp and yunchang on every grid; the ring-only peers next to the 1 x P grid (first
    when that grid is not asked for)."""
    rows = [] if (1, sp) in args.grids else ring_peers(args, sp)
    for u, r in args.grids:
        if "usp" in args.peers:
            for impl in args.usp_ring_impls if r > 1 else ["-"]:
                rows.append(Peer("usp", u, r, impl, args.usp_backend))
        if (u, r) == (1, sp):
            rows += ring_peers(args, sp)
        if "yunchang" in args.peers:
            rows.append(Peer("yunchang", u, r, "zigzag", "flash-attn"))
    return rows


def default_grids(sp: int, cuda: bool) -> list[tuple[int, int]]:
    """The pure ring (what torch CP and ring-flash-attn do) and one hybrid grid: ulysses 4
    on a GPU (a Llama-3 GQA group), 2 on CPU (the tiny preset has 2 KV heads)."""
    ulysses = math.gcd(sp, 4 if cuda else 2)
    return [(1, sp)] + ([(ulysses, sp // ulysses)] if ulysses > 1 else [])


def parse_args(argv, device: torch.device):
    cuda = device.type == "cuda"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--preset", choices=sorted(emulate.PRESETS), default="llama3-8b" if cuda else "tiny"
    )
    p.add_argument(
        "--seqlen", type=int, default=131072 if cuda else 512, help="tokens of the sequence"
    )
    p.add_argument("--sp", type=int, default=8 if cuda else 4, help="sequence-parallel ranks P")
    p.add_argument(
        "--grids",
        type=emulate.parse_grid,
        nargs="+",
        default=None,
        help="usp/yunchang (ulysses, ring) grids as UxR (default: 1xP and one hybrid)",
    )
    p.add_argument("--peers", nargs="+", choices=PEERS, default=None)
    p.add_argument("--usp-backend", default="cudnn" if cuda else "cpu")
    p.add_argument(
        "--usp-ring-impls", nargs="+", choices=["p2p", "allgather"], default=["p2p", "allgather"]
    )
    p.add_argument(
        "--torch-backends",
        nargs="+",
        choices=["cudnn", "flash", "efficient"],
        default=["cudnn", "flash"] if cuda else ["flash"],
        help="SDPA backends for torch-cp (CPU: the CPU flash kernel)",
    )
    p.add_argument(
        "--torch-rotates",
        nargs="+",
        choices=["allgather", "alltoall"],
        default=["allgather", "alltoall"],
    )
    p.add_argument("--dtype", choices=sorted(emulate.DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--ranks-per-node", type=int, default=None, help="for usp's topology (default min(8, P))"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5 if cuda else 3)
    p.add_argument("--monolithic-repeats", type=int, default=3)
    p.add_argument("--max-monolithic-tokens", type=int, default=65536)
    p.add_argument("--out", type=Path, default=None, help="directory for peers.json and peers.md")
    args = p.parse_args(argv)
    if args.peers is None:  # the CPU stand-in only where the real torch-cp cannot run
        args.peers = [n for n in PEERS if not (cuda and n == "torch-cp-ring")]
    if args.grids is None:
        args.grids = default_grids(args.sp, cuda)
    for u, r in args.grids:
        if u * r != args.sp:
            p.error(f"grid {u}x{r}: ulysses * ring = {u * r} != --sp {args.sp}")
    return args


# ------------------------------------------------------------------ reporting
def _fmt(value, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def setup_text(setup: Setup, rows: list[dict]) -> str:
    s = setup.shape
    device = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "CPU"
    notes = sorted({r["monolithic_note"] for r in rows if r.get("monolithic_note")})
    lines = [
        f"torch {torch.__version__}, {device}, {setup.dtype}, causal, {setup.preset} heads "
        f"(H={s.heads}, Hkv={s.kv_heads}, D={s.head_dim}), batch {setup.batch}, "
        f"{setup.seqlen} tokens on P={setup.sp} ranks ({setup.local_len} per rank); "
        f"rank 0 of a fake process group (every peer balances causal work: zigzag / "
        f"head-tail); median of {setup.repeats} after {setup.warmup} warm-up",
        "monolithic references (one call over the whole sequence, same kernel class): "
        + ("; ".join(notes) or "none measured"),
        "bytes: counted at the collectives each peer issues (send, all-to-all, all-gather, "
        "reduce-scatter; the part a rank keeps is not counted); no data moves under the "
        "fake backend, so no time is spent communicating",
    ]
    if setup.device.type != "cuda":
        lines.append("CPU run: the times say nothing about GPUs (tiny sizes, shared cores)")
    return "\n".join(lines)


def compute_table(rows: list[dict]) -> str:
    lines = [
        "| peer | u x r | variant | kernel | fwd ms | fwd+bwd ms | TFLOP/s/rank "
        "| monolithic/P ms | efficiency | peak GiB | sent MB | status |",
        "|" + "---|" * 12,
    ]
    for i, r in enumerate(rows, 1):
        ok = r["status"] == "ok"
        status = "ok" if ok else f"{r['status']} [{i}]"
        peak = r.get("peak_mem_bytes")
        lines.append(
            f"| {r['name']} | {r['ulysses']} x {r['ring']} | {r['variant']} | {r['kernel']} "
            f"| {_fmt(r.get('fwd_ms'))} | {_fmt(r.get('fwd_bwd_ms'))} "
            f"| {_fmt(r.get('tflops_per_rank'))} | {_fmt(r.get('ideal_ms'))} "
            f"| {_fmt(r.get('efficiency'), '.1%')} "
            f"| {_fmt(None if peak is None else peak / emulate.GIB)} "
            f"| {_fmt(None if not ok else r['bytes_sent'] / MB, '.4g')} | {status} |"
        )
    return "\n".join(lines)


def traffic_table(rows: list[dict]) -> str:
    lines = [
        "| peer | u x r | variant | kernel | pass | kind | calls | sent MB | received MB |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        if r["status"] != "ok":
            continue
        for phase, kinds in r["traffic"].items():
            for kind, c in sorted(kinds.items()):
                lines.append(
                    f"| {r['name']} | {r['ulysses']} x {r['ring']} | {r['variant']} "
                    f"| {r['kernel']} | {phase} | {kind} | {c['calls']} "
                    f"| {c['sent'] / MB:.4g} | {c['received'] / MB:.4g} |"
                )
    return "\n".join(lines)


def notes_text(rows: list[dict]) -> str:
    lines = []
    for i, r in enumerate(rows, 1):
        if r["status"] != "ok":
            lines.append(f"[{i}] {r['label']}: {r['status']}: {r['reason']}")
            continue
        extra = list(r["notes"])
        if r.get("comm_stats") is not None:
            extra.append(
                "usp's comm_stats equal the intercepted bytes"
                if r["comm_stats_agree"]
                else f"usp's comm_stats DIFFER from the intercepted bytes: {r['comm_stats']}"
            )
        if r["unrecognised_collectives"]:
            extra.append(f"not counted: {', '.join(r['unrecognised_collectives'])}")
        lines.append(f"- {r['label']}: " + "; ".join(extra))
    return "\n".join(lines)


def markdown(setup: Setup, rows: list[dict]) -> str:
    return "\n\n".join(
        [
            setup_text(setup, rows),
            "### One rank, side by side",
            compute_table(rows),
            "### Traffic per rank",
            traffic_table(rows),
            "### Notes",
            notes_text(rows),
        ]
    )


def main(argv: list[str] | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args = parse_args(argv, device)
    setup = Setup(
        preset=args.preset,
        seqlen=args.seqlen,
        sp=args.sp,
        dtype=args.dtype,
        batch=args.batch,
        ranks_per_node=args.ranks_per_node or min(8, args.sp),
        device=device,
        warmup=args.warmup,
        repeats=args.repeats,
        monolithic_repeats=args.monolithic_repeats,
        max_monolithic_tokens=args.max_monolithic_tokens,
    )
    rows, references = [], {}
    for peer in peers_of(args, setup.sp):
        row = run_peer(peer, setup, references)
        shown = _fmt(row.get("fwd_bwd_ms"))
        print(f"{peer.label()}: {row['status']} {shown} ms {row['reason'] or ''}", flush=True)
        rows.append(row)
    text = markdown(setup, rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"setup": setup_text(setup, rows), "rows": rows}
        (args.out / "peers.json").write_text(json.dumps(payload, indent=1, default=str))
        (args.out / "peers.md").write_text(text + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(1 if any(r["status"] == "failed" for r in main()) else 0)

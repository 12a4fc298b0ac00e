"""Host overhead of one ``usp_attention`` layer call (forward + backward), per grid.

    python benchmarks/host_overhead.py [--repeats 200] [--grids 8x1 4x2 1x8]
    python benchmarks/host_overhead.py --device cuda --out results/   # on a GPU (or auto)

One process acts as rank 0 of a world of 8 (PyTorch's ``fake`` process-group backend:
collectives return at once, so nothing is spent communicating) and runs the real
``usp_attention`` forward and backward at tiny shapes (8 query / 2 KV heads, head dim 16,
16 tokens per rank, float32, causal, zigzag, p2p, backend ``cpu``), dense and packed
(a few documents, packed once with ``plan.pack`` as a training step does).

What is reported per layer call (median over ``--repeats`` calls, ``perf_counter``):
- ``total_ms``: the whole forward + backward of the call;
- ``kernel_ms``: the time spent inside the bare kernel calls it makes, measured by
  wrapping the backend's ``forward``/``backward``/``varlen_*`` methods with timers (the
  timer itself is included: two ``perf_counter`` calls per kernel call);
- ``overhead_ms`` = total - kernel: validation, dispatch, the ring and Ulysses loops,
  merges, accumulators and the (instant) fake collectives: the host cost a GPU run pays
  per layer on top of its kernels, whose launches are asynchronous there;
- ``best_overhead_ms``: the smallest overhead of any single repeat (less sensitive to
  other processes sharing the CPU than the median);
- ``kernel_calls``: how many kernel calls one layer call makes;
- ``aten_ops``: how many aten ops one layer call dispatches outside its kernel calls,
  forward and backward (counted once, with a ``TorchDispatchMode``): host work that
  does not depend on the machine's load (what the kernels do inside is left out: the
  ``cpu`` backend sends calls with non-finite inputs to ``math``, and the fake
  collectives leave garbage, sometimes NaN, in received buffers).

Tiny shapes make the kernels cheap, so the overhead dominates and is what this
measures; it is not a throughput benchmark (see ``emulate.py``).

``--compile`` measures each case twice in the same run: eager, and the same layer call
compiled (``torch.compile(fullgraph=True)``, Inductor with ``usp.compile_options()`` by
default, ``--compile-backend`` to change it), their repeats interleaved so that both see
the same load: the rows gain ``compiled`` and ``compile_s`` (the first call: tracing and
code generation, forward and backward), and the table the compiled overhead over the
eager one; the compiled call's ``aten_ops`` are not counted (None: a
``TorchDispatchMode`` makes Dynamo run the call eagerly).

``--device cuda`` runs the same calls on the GPU in bf16 with ``--backend auto`` (by
default): the times are then host times, the GPU running behind (nothing waits for it
inside a repeat; each repeat ends with a synchronize outside the timed part), and
``device_ms`` is the GPU time the call spans (CUDA events around it): close to
``total_ms`` when the call is host-bound. The fake group skips ``batch_isend_irecv``,
which NCCL needs, so a real NCCL ring pays more per exchange than this shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import usp
from usp.kernels.backends import registry
from usp.options import BACKEND_NAMES, BACKENDS
from usp.process_groups.fake import fake_world
from usp.train.components import default_compute_dtype

HEADS, KV_HEADS, HEAD_DIM, LOCAL_LEN, WORLD = 8, 2, 16, 16, 8
#: document lengths of the packed case (fractions of the global sequence)
DOC_SHARES = (0.5, 0.25, 0.25)
_KERNEL_METHODS = ("forward", "backward", "varlen_forward", "varlen_backward")
CPU = torch.device("cpu")


class KernelTimer:
    """Accumulates the time spent inside the backends' kernel methods while installed
    (every backend class, since ``auto`` and the fallbacks can reach any of them; a
    kernel method that calls another backend's counts once)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.depth = 0  # > 0 inside a kernel call (what OpCounter leaves out)

    @property
    def inside(self) -> bool:
        return self.depth > 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @contextmanager
    def installed(self):
        classes = {type(registry.get(name)) for name in BACKEND_NAMES}
        originals = {
            (cls, name): cls.__dict__[name]
            for cls in classes
            for name in _KERNEL_METHODS
            if name in cls.__dict__
        }

        def timed(original):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                self.depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self.depth -= 1
                    if self.depth == 0:
                        self.seconds += time.perf_counter() - start
                        self.calls += 1

            return wrapper

        for (cls, name), original in originals.items():
            setattr(cls, name, timed(original))
        try:
            yield self
        finally:
            for (cls, name), original in originals.items():
                setattr(cls, name, original)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (forward and backward): a measure of
    host work that, unlike time, does not depend on what else runs on the machine."""

    def __init__(self, timer: KernelTimer):
        super().__init__()
        self.ops = 0
        self.timer = timer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not self.timer.inside
        return func(*args, **(kwargs or {}))


def _document_bounds(seq_len: int, multiple: int) -> torch.Tensor:
    bounds, start = [0], 0
    for share in DOC_SHARES[:-1]:
        start += max(multiple, int(seq_len * share) // multiple * multiple)
        bounds.append(start)
    bounds.append(seq_len)
    return torch.tensor(bounds, dtype=torch.int32)


def measure(
    ulysses: int, ring: int, packed: bool, repeats: int, warmup: int, backend: str,
    device: torch.device = CPU, compile_backends: tuple[str | None, ...] = (None,),
) -> list[dict]:  # fmt: skip
    """One grid, per layer call, for each of ``compile_backends`` (None: eager; a name:
    the call compiled with ``torch.compile(fullgraph=True, backend=...)``, Inductor with
    ``usp.compile_options()``; its first call, not timed as a repeat, gives
    ``compile_s``): median total and kernel milliseconds, their difference, the smallest
    overhead of any repeat, the kernel calls and aten ops, and on CUDA the median GPU
    time the call spans (``device_ms``; None on the CPU). The variants' repeats are
    interleaved (eager, compiled, eager, ...), so that both see the same load: their
    ratio is measured side by side, not an hour apart."""
    timer = KernelTimer()
    cuda = device.type == "cuda"
    dtype = default_compute_dtype(device)  # what training computes in
    with fake_world(WORLD, 0, device):
        topo = usp.build_topology(ulysses, ring, ranks_per_node=WORLD)
        try:
            plan = usp.Plan(topo, layout="zigzag", ring_impl="p2p", backend=backend)
            seq_len = LOCAL_LEN * WORLD
            gen = torch.Generator().manual_seed(0)

            def tensor(heads: int, grad: bool = True) -> torch.Tensor:
                x = torch.randn(1, LOCAL_LEN, heads, HEAD_DIM, generator=gen)
                return x.to(device, dtype).requires_grad_(grad)

            q, k, v = tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)
            dout = tensor(HEADS, grad=False)
            documents = None
            if packed:
                documents = plan.pack(_document_bounds(seq_len, 2 * WORLD), device=device)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None

            def call(q, k, v):
                return plan.attention(q, k, v, causal=True, packed=documents)

            torch._dynamo.reset()
            variants = [
                _Variant(call, compile_backend, q, k, v, dout)
                for compile_backend in compile_backends
            ]
            with timer.installed():
                for i in range(warmup + repeats):
                    for variant in variants:
                        timer.reset()
                        if cuda:
                            events[0].record()
                        start = time.perf_counter()
                        out = variant.call(q, k, v)
                        torch.autograd.grad(out, (q, k, v), dout)
                        elapsed = time.perf_counter() - start
                        if cuda:  # outside the timed part: the next repeat starts on an idle GPU
                            events[1].record()
                            torch.cuda.synchronize()
                        if i >= warmup:
                            span = events[0].elapsed_time(events[1]) / 1e3 if cuda else None
                            variant.record(elapsed, timer.seconds, timer.calls, span)
            for variant in variants:
                if variant.compile_backend is None:  # compiled code runs under no dispatch mode
                    counter = OpCounter(timer)
                    with timer.installed(), counter:
                        out = call(q, k, v)
                        torch.autograd.grad(out, (q, k, v), dout)
                    variant.aten_ops = counter.ops
        finally:
            topo.destroy()
            torch._dynamo.reset()  # compiled graphs hold the fake world's groups
    return [variant.row() for variant in variants]


class _Variant:
    """One way of making the layer call (eager or compiled) and its samples."""

    def __init__(self, call, compile_backend: str | None, q, k, v, dout):
        self.compile_backend = compile_backend
        self.call, self.compile_s, self.aten_ops = call, None, None
        self.totals, self.kernels, self.spans, self.calls = [], [], [], 0
        if compile_backend is not None:
            options = {"options": usp.compile_options()} if compile_backend == "inductor" else {}
            self.call = torch.compile(call, fullgraph=True, backend=compile_backend, **options)
            start = time.perf_counter()
            torch.autograd.grad(self.call(q, k, v), (q, k, v), dout)
            self.compile_s = time.perf_counter() - start

    def record(self, total: float, kernel: float, calls: int, span: float | None) -> None:
        self.totals.append(total)
        self.kernels.append(kernel)
        self.calls = calls
        if span is not None:
            self.spans.append(span)

    def row(self) -> dict:
        total, kernel = statistics.median(self.totals), statistics.median(self.kernels)
        return {
            "total_ms": total * 1e3,
            "kernel_ms": kernel * 1e3,
            "overhead_ms": (total - kernel) * 1e3,
            "best_overhead_ms": min(t - k for t, k in zip(self.totals, self.kernels)) * 1e3,
            "kernel_calls": self.calls,
            "aten_ops": self.aten_ops,
            "device_ms": statistics.median(self.spans) * 1e3 if self.spans else None,
            "compiled": self.compile_backend is not None,
            "compile_s": self.compile_s,
        }


def _line(row: dict, eager: dict, device: torch.device, compiling: bool) -> str:
    case = f"u{row['ulysses']}xr{row['ring']}" + (" pk" if row["packed"] else "")
    case += " compiled" if row["compiled"] else ""
    line = (
        f"{case:<16} {row['total_ms']:>9.3f} {row['kernel_ms']:>10.3f} "
        f"{row['overhead_ms']:>12.3f} {row['best_overhead_ms']:>12.3f} "
        f"{row['kernel_calls']:>6} {'-' if row['aten_ops'] is None else row['aten_ops']:>9}"
    )
    if device.type == "cuda":
        line += f" {row['device_ms']:>10.3f}"
    if compiling and row["compiled"]:
        ratio = row["overhead_ms"] / eager["overhead_ms"]
        line += f" {ratio:>9.2f} {row['compile_s']:>10.1f}"
    return line


def parse_grid(text: str) -> tuple[int, int]:
    u, _, r = text.partition("x")
    if not (u.isdigit() and r.isdigit()) or int(u) * int(r) != WORLD:
        raise argparse.ArgumentTypeError(f"grid {text!r} must be UxR with U*R = {WORLD}")
    return int(u), int(r)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", nargs="+", type=parse_grid, default=[(8, 1), (4, 2), (1, 8)])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda", "auto"), help="auto: cuda if visible"
    )
    parser.add_argument(
        "--backend", default=None, choices=BACKENDS, help="default: cpu on the CPU, auto on CUDA"
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for host_overhead.json")
    parser.add_argument(
        "--compile", action="store_true", help="each case eager and compiled, in this run"
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend for --compile"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU visible to torch; this machine has none")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    backend = args.backend or ("auto" if device.type == "cuda" else "cpu")
    torch.set_num_threads(1)
    rows = []
    dtype = str(default_compute_dtype(device)).removeprefix("torch.")
    setup = (
        f"rank 0 of a fake world of {WORLD}, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, "
        f"{LOCAL_LEN} tokens/rank, {dtype}, causal, zigzag, p2p, {device.type}, backend "
        f"{backend}, torch {torch.__version__}"
    )
    if args.compile:
        setup += f"; compiled: torch.compile(fullgraph=True, backend={args.compile_backend!r})"
    print(f"host overhead per usp_attention layer call (fwd+bwd), {setup}")
    print(
        f"{'case':<16} {'total ms':>9} {'kernel ms':>10} {'overhead ms':>12} "
        f"{'best ovh ms':>12} {'calls':>6} {'aten ops':>9}"
        + (f" {'device ms':>10}" if device.type == "cuda" else "")
        + (f" {'ovh/eager':>9} {'compile s':>10}" if args.compile else "")
    )
    backends = (None, args.compile_backend) if args.compile else (None,)
    for packed in (False, True):
        for u, r in args.grids:
            measured = measure(u, r, packed, args.repeats, args.warmup, backend, device, backends)
            case = [{"ulysses": u, "ring": r, "packed": packed, **result} for result in measured]
            for row in case:  # the eager row first
                print(_line(row, case[0], device, args.compile))
            rows.extend(case)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"setup": setup, "rows": rows}
        (args.out / "host_overhead.json").write_text(json.dumps(payload, indent=1))
    return rows


if __name__ == "__main__":
    main()

"""Host overhead of one ``usp_attention`` layer call (forward + backward), per grid.

    python benchmarks/host_overhead.py [--repeats 200] [--grids 8x1 4x2 1x8]

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
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import usp
from usp.kernels.backends import registry
from usp.process_groups.fake import fake_world

HEADS, KV_HEADS, HEAD_DIM, LOCAL_LEN, WORLD = 8, 2, 16, 16, 8
#: document lengths of the packed case (fractions of the global sequence)
DOC_SHARES = (0.5, 0.25, 0.25)
_KERNEL_METHODS = ("forward", "backward", "varlen_forward", "varlen_backward")


class KernelTimer:
    """Accumulates the time spent inside a backend's kernel methods while installed."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.inside = False  # in a kernel call (what OpCounter leaves out)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @contextmanager
    def installed(self, backend_name: str):
        impl = registry.get(backend_name)
        cls = type(impl)
        originals = {name: getattr(cls, name) for name in _KERNEL_METHODS}

        def timed(original):
            def wrapper(*args, **kwargs):
                start, self.inside = time.perf_counter(), True
                try:
                    return original(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1
                    self.inside = False

            return wrapper

        for name, original in originals.items():
            setattr(cls, name, timed(original))
        try:
            yield self
        finally:
            for name, original in originals.items():
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


def measure(ulysses: int, ring: int, packed: bool, repeats: int, warmup: int, backend: str):
    """One grid, per layer call: median total seconds, median kernel seconds, the smallest
    overhead (total - kernel) of any repeat, the number of kernel calls and of aten ops."""
    timer = KernelTimer()
    with fake_world(WORLD, 0, torch.device("cpu")):
        topo = usp.build_topology(ulysses, ring, ranks_per_node=WORLD)
        try:
            plan = usp.Plan(topo, layout="zigzag", ring_impl="p2p", backend=backend)
            seq_len = LOCAL_LEN * WORLD
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(1, LOCAL_LEN, HEADS, HEAD_DIM, generator=gen).requires_grad_()
            k = torch.randn(1, LOCAL_LEN, KV_HEADS, HEAD_DIM, generator=gen).requires_grad_()
            v = torch.randn(1, LOCAL_LEN, KV_HEADS, HEAD_DIM, generator=gen).requires_grad_()
            dout = torch.randn(1, LOCAL_LEN, HEADS, HEAD_DIM, generator=gen)
            documents = None
            if packed:
                documents = plan.pack(_document_bounds(seq_len, 2 * WORLD))
            totals, kernels, calls = [], [], 0
            with timer.installed(backend):
                for i in range(warmup + repeats):
                    timer.reset()
                    start = time.perf_counter()
                    out = plan.attention(q, k, v, causal=True, packed=documents)
                    torch.autograd.grad(out, (q, k, v), dout)
                    elapsed = time.perf_counter() - start
                    if i >= warmup:
                        totals.append(elapsed)
                        kernels.append(timer.seconds)
                        calls = timer.calls
            counter = OpCounter(timer)
            with timer.installed(backend), counter:
                out = plan.attention(q, k, v, causal=True, packed=documents)
                torch.autograd.grad(out, (q, k, v), dout)
        finally:
            topo.destroy()
    overheads = [t - k for t, k in zip(totals, kernels)]
    return statistics.median(totals), statistics.median(kernels), min(overheads), calls, counter.ops


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
    parser.add_argument("--backend", default="cpu", choices=("cpu", "math"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(
        f"host overhead per usp_attention layer call (fwd+bwd), rank 0 of a fake world of "
        f"{WORLD}, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, {LOCAL_LEN} tokens/rank, "
        f"float32, causal, zigzag, p2p, backend {args.backend}, torch {torch.__version__}"
    )
    print(
        f"{'case':<10} {'total ms':>9} {'kernel ms':>10} {'overhead ms':>12} "
        f"{'best ovh ms':>12} {'calls':>6} {'aten ops':>9}"
    )
    for packed in (False, True):
        for u, r in args.grids:
            total, kernel, best, calls, ops = measure(
                u, r, packed, args.repeats, args.warmup, args.backend
            )
            row = {
                "ulysses": u,
                "ring": r,
                "packed": packed,
                "total_ms": total * 1e3,
                "kernel_ms": kernel * 1e3,
                "overhead_ms": (total - kernel) * 1e3,
                "best_overhead_ms": best * 1e3,
                "kernel_calls": calls,
                "aten_ops": ops,
            }
            rows.append(row)
            case = f"u{u}xr{r}" + (" pk" if packed else "")
            print(
                f"{case:<10} {row['total_ms']:>9.3f} {row['kernel_ms']:>10.3f} "
                f"{row['overhead_ms']:>12.3f} {row['best_overhead_ms']:>12.3f} {calls:>6} {ops:>9}"
            )
    return rows


if __name__ == "__main__":
    main()

"""The compiled layer call captured as a CUDA graph: a self-checking step of gpu_check.sh.

    python benchmarks/cuda_graph_check.py --out results/      # on a GPU (bf16, backend auto)
    python benchmarks/cuda_graph_check.py --device cpu        # the same checks, no CUDA graphs

One ``usp_attention`` layer call (forward + backward, causal, zigzag, p2p) is compiled
with ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (Inductor's CUDA graphs,
``usp.compile_options()``, and ``cudagraph_or_error``: a call that would not be captured
is an error, not a silent eager fallback). Cases:

- ``u1xr1`` dense and packed (``Plan(None)``: a ring of one, no communication): the
  replayed graph must equal the eager call (relative error of the output and of each
  gradient within ``--tol``, default 2e-2 for bf16);
- ``u1xr8`` and ``u4xr2`` dense and packed, as rank 0 of a fake world of 8 (the
  ``fake`` backend: collectives return at once, received buffers hold garbage, so
  only the capture and its host time are checked; the GPU time the call spans is
  reported).

Per case: host milliseconds per call eager, compiled without CUDA graphs, and replayed
(median of ``--repeats``), the GPU time of a replay, and ``captured``. Exit status 1
when any case fails (not captured, an exception, or an exact case beyond ``--tol``);
results in ``OUT/cuda_graph.json``. ``--device cpu`` runs every case without CUDA
graphs (mode default; ``--compile-backend`` as given): a test of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import usp
from usp.process_groups.fake import fake_world
from usp.train.components import default_compute_dtype

HEADS, KV_HEADS, HEAD_DIM, LOCAL_LEN, WORLD = 8, 2, 64, 256, 8
#: (ulysses, ring, packed), most telling first: gpu_check.sh runs the first two
CASES = [(1, 1, True), (1, 8, False), (1, 1, False), (1, 8, True), (4, 2, False), (4, 2, True)]


def _documents(seq_len: int, multiple: int) -> torch.Tensor:
    half = seq_len // 2 // multiple * multiple
    return torch.tensor([0, half, half + multiple, seq_len], dtype=torch.int32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(call, q, k, v, dout, repeats: int, device: torch.device, mark_steps: bool):
    """Median host milliseconds of ``call`` forward + backward (the GPU runs behind;
    synchronised outside the timed part), and the last call's outputs (cloned)."""
    times, result = [], None
    for _ in range(repeats + 2):  # two warm-up calls (a CUDA graph records on the second)
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        start = time.perf_counter()
        out = call(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        times.append(time.perf_counter() - start)
        result = [t.detach().clone() for t in (out, *grads)]
        _sync(device)
    return statistics.median(times[2:]) * 1e3, result


def _device_ms(call, q, k, v, dout, device: torch.device, mark_steps: bool) -> float | None:
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if mark_steps:
        torch.compiler.cudagraph_mark_step_begin()
    start.record()
    torch.autograd.grad(call(q, k, v), (q, k, v), dout)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def run_case(ulysses, ring, packed, device, args) -> dict:
    world = ulysses * ring
    cuda = device.type == "cuda"
    dtype = default_compute_dtype(device)
    row = {"case": f"u{ulysses}xr{ring}" + (" packed" if packed else ""), "exact": world == 1}
    scope = fake_world(world, 0, device) if world > 1 else contextlib.nullcontext()
    with scope:
        topo = usp.build_topology(ulysses, ring, ranks_per_node=WORLD) if world > 1 else None
        try:
            plan = usp.Plan(topo, backend=args.backend)
            gen = torch.Generator().manual_seed(0)

            def tensor(heads, grad=True):
                x = torch.randn(1, LOCAL_LEN, heads, HEAD_DIM, generator=gen)
                return x.to(device, dtype).requires_grad_(grad)

            q, k, v = tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)
            dout = tensor(HEADS, grad=False)
            seq = LOCAL_LEN * world
            documents = plan.pack(_documents(seq, 2 * world), device=device) if packed else None

            def eager(q, k, v):
                return plan.attention(q, k, v, causal=True, packed=documents)

            row["eager_ms"], want = _timed(eager, q, k, v, dout, args.repeats, device, False)
            torch._dynamo.reset()
            inductor = args.compile_backend == "inductor"
            compiled = torch.compile(
                eager, fullgraph=True, backend=args.compile_backend,
                options=usp.compile_options() if inductor else None,
            )  # fmt: skip
            row["compiled_ms"], got = _timed(compiled, q, k, v, dout, args.repeats, device, False)
            if cuda:
                options = {**usp.compile_options(), "triton.cudagraphs": True,
                           "triton.cudagraph_or_error": True}  # fmt: skip
                torch._dynamo.reset()
                graphed = torch.compile(eager, fullgraph=True, options=options)
                row["graph_ms"], got = _timed(graphed, q, k, v, dout, args.repeats, device, True)
                row["device_ms"] = _device_ms(graphed, q, k, v, dout, device, True)
                row["captured"] = True  # cudagraph_or_error: a skip would have raised
            else:  # no CUDA graphs: the compiled call is what is checked
                row["graph_ms"], row["device_ms"], row["captured"] = row["compiled_ms"], None, None
            if row["exact"]:
                row["error"] = max(
                    ((g.float() - w.float()).norm() / w.float().norm()).item()
                    for g, w in zip(got, want)
                )
        finally:
            torch._dynamo.reset()
            if topo is not None:
                topo.destroy()
    return row


def _cell(value, spec: str) -> str:
    """``value`` formatted with ``spec`` ("-" in its width for None)."""
    if value is None:
        return format("-", spec.split(".")[0])
    return format(value, spec)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backend", default=None, help="attention backend (auto on CUDA, cpu)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tol", type=float, default=None, help="2e-2 on CUDA (bf16), 1e-5 on CPU")
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N cases")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda needs a CUDA GPU visible to torch; --device cpu tests the script"
        )
    device = torch.device(args.device)
    args.backend = args.backend or ("auto" if device.type == "cuda" else "cpu")
    args.tol = args.tol if args.tol is not None else (2e-2 if device.type == "cuda" else 1e-5)
    torch.set_num_threads(1)
    rows, failures = [], []
    print(f"{'case':<14} {'eager ms':>9} {'compiled ms':>12} {'graph ms':>9} {'device ms':>10} "
          f"{'captured':>9} {'error':>9}")  # fmt: skip
    for ulysses, ring, packed in CASES[: args.cases]:
        try:
            row = run_case(ulysses, ring, packed, device, args)
        except Exception as err:  # noqa: BLE001 - a failed case is reported, the rest still run
            row = {
                "case": f"u{ulysses}xr{ring}" + (" packed" if packed else ""),
                "failed": repr(err),
            }
        rows.append(row)
        if "failed" in row:
            failures.append(f"{row['case']}: {row['failed']}")
            print(f"{row['case']:<14} FAILED: {row['failed']}")
            continue
        if row["exact"] and not row["error"] <= args.tol:
            failures.append(f"{row['case']}: relative error {row['error']:.2e} > {args.tol}")
        print(f"{row['case']:<14} {row['eager_ms']:>9.3f} {row['compiled_ms']:>12.3f} "
              f"{row['graph_ms']:>9.3f} {_cell(row['device_ms'], '>10.3f')} "
              f"{_cell(row['captured'], '>9')} {_cell(row.get('error'), '>9.1e')}")  # fmt: skip
    verdict = "all ok" if not failures else "FAILED: " + "; ".join(failures)
    print(verdict)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        setup = {"device": str(device), "backend": args.backend, "torch": torch.__version__}
        payload = {"setup": setup, "rows": rows, "verdict": verdict}
        (args.out / "cuda_graph.json").write_text(json.dumps(payload, indent=1))
    if failures:
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()

"""Where a compiled layer call's communication waits land: the order of collectives,
waits and kernels in the code Inductor generates for one ``usp_attention`` call,
forward and backward, with Inductor's default options and with
``usp.compile_options()`` (its scheduling pass, :mod:`usp.comm.overlap`).

    python benchmarks/compiled_schedule.py [--grid 1x4] [--ring-impl p2p] [--out DIR]

One process is rank 0 of a fake world (``fake`` process-group backend: the generated
code is that of a real rank; nothing moves), tiny shapes as ``host_overhead.py``,
float32, causal, zigzag, backend ``cpu``. Each line of the listing is one statement of
the generated ``call``: ``post <collective> -> bufN``, ``wait bufN``, ``kernel <usp
op>``, ``fused <Inductor C++ kernel>``. A shift is overlapped when a kernel stands
between its post and its wait. The script counts them and exits 1 when, with
``usp.compile_options()``, a forward shift is not overlapped.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

import usp
from usp.process_groups.fake import fake_world

HEADS, KV_HEADS, HEAD_DIM, LOCAL_LEN = 8, 2, 16, 16
_POST = re.compile(r"(\w+) = torch\.ops\._c10d_functional\.(\w+)\.default\(")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
_KERNEL = re.compile(r"\w+ = torch\.ops\.usp\.(\w+)\.default\(")
_FUSED = re.compile(r"(cpp_fused_\w+)\(")


def _generated_code(ulysses: int, ring: int, ring_impl: str, options: dict | None) -> list[str]:
    """The source of the modules Inductor generates (forward, backward) for one call."""
    from torch._inductor import graph as inductor_graph

    sources = []
    compile_to_module = inductor_graph.GraphLowering.compile_to_module

    def capture(self, *args, **kwargs):
        module = compile_to_module(self, *args, **kwargs)
        sources.append(Path(module.__file__).read_text())
        return module

    world = ulysses * ring
    inductor_graph.GraphLowering.compile_to_module = capture
    try:
        with (
            torch._inductor.config.patch(force_disable_caches=True),
            fake_world(world, 0, torch.device("cpu")),
        ):
            topo = usp.build_topology(ulysses, ring, ranks_per_node=world)
            try:
                plan = usp.Plan(topo, ring_impl=ring_impl, backend="cpu")
                q = torch.randn(1, LOCAL_LEN, HEADS, HEAD_DIM, requires_grad=True)
                k, v = (
                    torch.randn(1, LOCAL_LEN, KV_HEADS, HEAD_DIM, requires_grad=True) for _ in "kv"
                )
                torch._dynamo.reset()
                call = torch.compile(
                    lambda q, k, v: plan.attention(q, k, v, causal=True),
                    fullgraph=True, options=options,
                )  # fmt: skip
                out = call(q, k, v)
                torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            finally:
                topo.destroy()
                torch._dynamo.reset()
    finally:
        inductor_graph.GraphLowering.compile_to_module = compile_to_module
    return sources


def listing(source: str) -> list[str]:
    """The collectives, waits and kernels of a generated module's ``call``, in order."""
    body = source[source.index("def call(self, args)") :]
    lines = []
    for line in (raw.strip() for raw in body.splitlines()):
        if match := _POST.match(line):
            lines.append(f"post {match.group(2)} -> {match.group(1)}")
        elif match := _WAIT.match(line):
            lines.append(f"wait {match.group(1)}")
        elif match := _KERNEL.match(line):
            lines.append(f"kernel {match.group(1)}")
        elif match := _FUSED.match(line):
            lines.append(f"fused {match.group(1)}")
    return lines


def overlapped(lines: list[str]) -> tuple[int, int]:
    """(collectives with a kernel between their post and their wait, collectives)."""
    posts = [(i, line.rsplit(" ", 1)[1]) for i, line in enumerate(lines) if line.startswith("post")]
    count = 0
    for i, buf in posts:
        wait = lines.index(f"wait {buf}", i)
        count += any(line.startswith("kernel") for line in lines[i:wait])
    return count, len(posts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="1x4", help="UxR (default 1x4)")
    parser.add_argument("--ring-impl", default="p2p", choices=usp.ring.RING_IMPLS)
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for compiled_schedule.json"
    )
    args = parser.parse_args(argv)
    ulysses, ring = (int(x) for x in args.grid.split("x"))
    torch.set_num_threads(1)
    report = {}
    for label, options in (
        ("inductor defaults", None),
        ("usp.compile_options()", usp.compile_options()),
    ):
        forward, backward = (
            listing(s) for s in _generated_code(ulysses, ring, args.ring_impl, options)
        )
        report[label] = {"forward": forward, "backward": backward}
        for name, lines in (("forward", forward), ("backward", backward)):
            done, total = overlapped(lines)
            print(f"== u{ulysses}xr{ring} {args.ring_impl}, {label}, {name}: "
                  f"{done} of {total} collectives overlapped by a kernel")  # fmt: skip
            print("   " + "\n   ".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compiled_schedule.json").write_text(json.dumps(report, indent=1))
    forward = report["usp.compile_options()"]["forward"]
    shifts = sum(1 for line in forward if line.startswith("post all_to_all_single"))
    done, _ = overlapped(forward)
    if args.ring_impl == "p2p" and ring > 1 and ulysses == 1 and done < shifts:
        raise SystemExit(f"only {done} of the {shifts} forward shifts are overlapped")
    return report


if __name__ == "__main__":
    main()

"""Throughput of every local attention backend: TFLOP/s forward and forward+backward.

    python benchmarks/kernel_bench.py [--seqlens 8192 32768 131072] [--out results/]

Llama-3-8B head shapes (32 query heads, 8 KV heads, head dim 128), bf16, causal, batch
1. FLOPs count the visible half of the causal score matrix: forward 4*B*H*S^2*D/2,
backward 2.5x forward. Times are CUDA-event medians after a warm-up. Also runs on CPU
(tiny sizes) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from usp.kernels import BACKEND_NAMES, AttentionSpec, attention_backward, attention_forward
from usp.kernels.backends import registry


def causal_flops(batch: int, seqlen: int, heads: int, head_dim: int) -> float:
    return 4 * batch * heads * seqlen * seqlen * head_dim / 2


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_backend(
    backend, seqlen, *, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device, repeats=3
):
    spec = AttentionSpec(1, seqlen, seqlen, heads, kv_heads, head_dim, dtype, device, True, None)
    reason = registry.get(backend).unsupported_reason(spec)
    if reason is not None:
        return {"backend": backend, "seqlen": seqlen, "skipped": reason}
    q = torch.randn(1, seqlen, heads, head_dim, device=device, dtype=dtype)
    k, v = (
        torch.randn(1, seqlen, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)
    )
    dout = torch.randn_like(q)
    out, lse = attention_forward(q, k, v, causal=True, backend=backend)

    def forward():
        attention_forward(q, k, v, causal=True, backend=backend)

    def forward_backward():
        o, s = attention_forward(q, k, v, causal=True, backend=backend)
        attention_backward(dout, q, k, v, o, s, causal=True, backend=backend)

    fwd = timed(forward, repeats, device)
    fwd_bwd = timed(forward_backward, repeats, device)
    flops = causal_flops(1, seqlen, heads, head_dim)
    return {
        "backend": backend,
        "seqlen": seqlen,
        "fwd_ms": fwd * 1e3,
        "fwd_bwd_ms": fwd_bwd * 1e3,
        "fwd_tflops": flops / fwd / 1e12,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e12,
    }


def markdown(rows) -> str:
    lines = [
        "| backend | tokens | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['backend']} | {r['seqlen']} | — | — | skipped: {r['skipped']} | |")
        else:
            lines.append(
                f"| {r['backend']} | {r['seqlen']} | {r['fwd_tflops']:.3g} | {r['fwd_bwd_tflops']:.3g} "
                f"| {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument(
        "--seqlens", type=int, nargs="+", default=[8192, 32768, 131072] if cuda else [256, 512]
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=[b for b in BACKEND_NAMES if b != "math"] if cuda else ["cpu", "math"],
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for kernels.json and kernels.md"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    rows = [
        bench_backend(b, s, head_dim=args.head_dim, device=device, repeats=args.repeats)
        for s in args.seqlens
        for b in args.backends
    ]
    table = markdown(rows)
    header = f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}, bf16, causal, H=32 Hkv=8 D={args.head_dim}"
    print(header)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(
            json.dumps({"setup": header, "rows": rows}, indent=1)
        )
        (args.out / "kernels.md").write_text(header + "\n\n" + table + "\n")
    return rows


if __name__ == "__main__":
    main()

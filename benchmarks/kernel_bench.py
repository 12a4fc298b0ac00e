"""Throughput of every local attention backend: TFLOP/s forward and forward+backward.

    python benchmarks/kernel_bench.py [--seqlens 8192 32768 131072] [--out results/]

Llama-3-8B head shapes (32 query heads, 8 KV heads, head dim 128), bf16, causal, batch
1. FLOPs count the visible half of the causal score matrix: forward 4*B*H*S^2*D/2,
backward 2.5x forward. Times are CUDA-event medians after a warm-up. Also runs on CPU
(tiny sizes) so the script cannot rot.

Exit status 1 when a backend the build must have (``registry.expected_backends``: on
CUDA cudnn, flash, efficient, and flash_attn when installed; on CPU cpu, math) is
unavailable for these shapes (a failed self-check, a kernel missing from the build) or
raises while being timed; a package that is simply not installed (flash_attn) is
reported, not failed. The table says which backend ``auto`` picks, and which flash-attn
generation runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from usp.kernels import AttentionSpec, attention_backward, attention_forward, select_backend
from usp.kernels.backends import registry
from usp.kernels.backends.flash_attn import is_installed as flash_attn_installed
from usp.kernels.selection import unsupported_reason


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


def _unavailable(backend: str, reason: str, device: torch.device) -> tuple[str, str]:
    """(status, note) of a backend that refused the benchmark's call."""
    if backend == "flash_attn" and not flash_attn_installed():
        return "not installed", reason
    if backend in registry.expected_backends(device.type):
        return "failed", f"unavailable where it must run: {reason}"
    return "unsupported", reason


def bench_backend(
    backend, seqlen, *, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device, repeats=3
):
    row = {"backend": backend, "seqlen": seqlen}
    spec = AttentionSpec(1, seqlen, seqlen, heads, kv_heads, head_dim, dtype, device, True, None)
    impl = registry.get(backend)
    reason = unsupported_reason(impl, spec)
    if reason is not None:
        status, note = _unavailable(backend, reason, device)
        return {**row, "status": status, "note": note}
    row["label"] = impl.label(spec)
    try:
        q = torch.randn(1, seqlen, heads, head_dim, device=device, dtype=dtype)
        k, v = (
            torch.randn(1, seqlen, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)
        )
        dout = torch.randn_like(q)

        def forward():
            attention_forward(q, k, v, causal=True, backend=backend)

        def forward_backward():
            o, s = attention_forward(q, k, v, causal=True, backend=backend)
            attention_backward(dout, q, k, v, o, s, causal=True, backend=backend)

        fwd = timed(forward, repeats, device)
        fwd_bwd = timed(forward_backward, repeats, device)
    except Exception as err:  # an OOM or a kernel error is a failed row, not a crash
        return {**row, "status": "failed", "note": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flops = causal_flops(1, seqlen, heads, head_dim)
    return {
        **row,
        "status": "ok",
        "fwd_ms": fwd * 1e3,
        "fwd_bwd_ms": fwd_bwd * 1e3,
        "fwd_tflops": flops / fwd / 1e12,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e12,
    }


def auto_choice(*, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device, seqlen):
    """Which backend ``auto`` picks for the benchmark's shapes (dense and packed)."""
    row = {"backend": "auto", "seqlen": seqlen}
    for varlen in (False, True):
        spec = AttentionSpec(
            1, seqlen, seqlen, heads, kv_heads, head_dim, dtype, device, True, None, varlen=varlen
        )
        try:
            chosen = select_backend(spec)
            row["packed" if varlen else "dense"] = chosen.label(spec)
        except Exception as err:
            return {**row, "status": "failed", "note": f"{type(err).__name__}: {err}"}
    return {**row, "status": "ok"}


def failures(rows) -> list[dict]:
    return [r for r in rows if r["status"] == "failed"]


def markdown(rows) -> str:
    lines = [
        "| backend | tokens | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["backend"] == "auto" and r["status"] == "ok":
            lines.append(
                f"| auto | {r['seqlen']} | | | | | picks {r['dense']} (dense), {r['packed']} (packed) |"
            )
        elif r["status"] == "ok":
            lines.append(
                f"| {r['label']} | {r['seqlen']} | {r['fwd_tflops']:.3g} | {r['fwd_bwd_tflops']:.3g} "
                f"| {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | ok |"
            )
        else:
            note = r["note"].replace("|", "/").replace("\n", " ")
            status = "**FAILED**" if r["status"] == "failed" else r["status"]
            lines.append(f"| {r['backend']} | {r['seqlen']} | — | — | — | — | {status}: {note} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    known, _ = parser.parse_known_args(argv)
    cuda = known.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    parser.add_argument(
        "--seqlens", type=int, nargs="+", default=[8192, 32768, 131072] if cuda else [256, 512]
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=registry.BACKEND_NAMES,
        # on CUDA flash_attn is listed even when not installed: its row says so
        default=["cudnn", "flash_attn", "flash", "efficient"] if cuda else ["cpu", "math"],
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for kernels.json and kernels.md"
    )
    args = parser.parse_args(argv)
    rows = [auto_choice(head_dim=args.head_dim, device=device, seqlen=args.seqlens[0])]
    rows += [
        bench_backend(b, s, head_dim=args.head_dim, device=device, repeats=args.repeats)
        for s in args.seqlens
        for b in args.backends
    ]
    table = markdown(rows)
    header = (
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}, bf16, "
        f"causal, H=32 Hkv=8 D={args.head_dim}"
    )
    failed = failures(rows)
    verdict = f"FAILED: {', '.join(sorted({r['backend'] for r in failed}))}" if failed else "all ok"
    print(header)
    print(table)
    print(verdict)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(
            json.dumps({"setup": header, "verdict": verdict, "rows": rows}, indent=1)
        )
        (args.out / "kernels.md").write_text(f"{header}\n\n{table}\n\n{verdict}\n")
    return rows


if __name__ == "__main__":
    sys.exit(1 if failures(main()) else 0)

"""The MoE experts' time: the per-expert loop (transformers' scheme,
``usp.models.moe.experts_loop``) against usp's sorted scheme, run over contiguous segments
(one matmul pair per expert: float64, or any dtype with ``grouped_gemm = False``) and
with ``torch._grouped_mm`` (two grouped GEMMs, where torch has one for the dtype and
device). Forward and forward + backward, the variants' repeats interleaved (this VM moves
single runs by 2x), the median of each; the ratios are what to read. The outputs are
checked equal first.

    python benchmarks/moe_experts.py                       # CPU, two shapes, float32
    python benchmarks/moe_experts.py --device cuda --dtype bfloat16 --shapes qwen3-30b-a3b \
        --max-error 5e-2                                  # gpu_check.sh's moe_experts step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

#: (hidden, expert intermediate, experts, top_k, tokens): Qwen3-30B-A3B's layer at 512
#: tokens; a small shape where the per-expert host work dominates
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 512),
    "qwen3-30b-a3b-128": (2048, 768, 128, 8, 128),  # the same layer, 128 tokens
    "small": (256, 128, 32, 4, 512),
    "tiny": (32, 16, 4, 2, 16),  # tests
}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _variants(experts, x, idx, weights, dtype, device):
    """name -> a function running the experts on (x, idx, weights)."""
    from usp.models.moe import experts_loop, grouped_gemm_available

    def loop(x, i, w):
        return experts_loop(x, i, w, experts.gate_up_proj, experts.down_proj)

    def with_mode(mode):
        def run(x, i, w):
            experts.grouped_gemm = mode
            return experts(x, i, w)

        return run

    out = {"loop": loop, "segments": with_mode(False)}
    if grouped_gemm_available(dtype, device):
        out["grouped"] = with_mode(None)
    return out


def measure_shape(name, shape, *, dtype, device, repeats, seed=0, backward=True) -> dict:
    import torch

    from usp.models.moe import Experts, Router

    hidden, inner, num_experts, top_k, tokens = shape
    torch.manual_seed(seed)
    experts = Experts(num_experts, hidden, inner, top_k).to(device=device, dtype=dtype)
    experts.init_weights(0.02)
    router = Router(hidden, num_experts, top_k, True).to(device=device, dtype=dtype)
    router.init_weights(0.02)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    with torch.no_grad():
        _, weights, idx = router(x)
    variants = _variants(experts, x, idx, weights, dtype, device)
    with torch.no_grad():  # the variants agree before they are timed
        ref = variants["loop"](x, idx, weights).double()
        errors = {
            n: ((f(x, idx, weights).double() - ref).abs().max() / ref.abs().max()).item()
            for n, f in variants.items()
        }
    modes = ("forward", "forward_backward") if backward else ("forward",)
    times = {(n, m): [] for n in variants for m in modes}
    xg = x.clone().requires_grad_(True)
    for _ in range(repeats + 1):  # the first round warms up
        for n, f in variants.items():
            _sync(device)
            started = time.perf_counter()
            with torch.no_grad():
                f(x, idx, weights)
            _sync(device)
            times[(n, "forward")].append(time.perf_counter() - started)
            if backward:
                started = time.perf_counter()
                f(xg, idx, weights).sum().backward()
                _sync(device)
                times[(n, "forward_backward")].append(time.perf_counter() - started)
    ms = {f"{n} {m}": 1e3 * statistics.median(v[1:]) for (n, m), v in times.items()}
    ratios = {}
    for m in modes:
        for n in variants:
            if n != "loop":
                ratios[f"loop / {n} {m}"] = ms[f"loop {m}"] / ms[f"{n} {m}"]
    routed = torch.bincount(idx.reshape(-1), minlength=num_experts)
    return {
        "shape": name,
        "hidden": hidden,
        "intermediate": inner,
        "experts": num_experts,
        "top_k": top_k,
        "tokens": tokens,
        "experts_used": int((routed > 0).sum()),
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "max_relative_error": errors,
        "ms": ms,
        "ratios": ratios,
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "small"], choices=SHAPES)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto (cuda when there is one)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="a folder for moe_experts.json")
    p.add_argument("--forward-only", action="store_true",
                   help="no backward (the loop's backward at a real width is very slow on CPU)")  # fmt: skip
    p.add_argument("--max-error", type=float, default=None,
                   help="exit 1 when a variant differs from the loop by more (relative)")  # fmt: skip
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for name in args.shapes:
        row = measure_shape(name, SHAPES[name], dtype=dtype, device=device, repeats=args.repeats,
                            backward=not args.forward_only)  # fmt: skip
        rows.append(row)
        cells = ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items())
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items())
        print(f"{name} ({row['dtype']}, {row['device']}, {args.threads} thread(s)): {cells}")
        print(
            f"  {times}; max relative error vs loop {max(row['max_relative_error'].values()):.1e}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_experts.json").write_text(json.dumps(rows, indent=1) + "\n")
    worst = max(max(r["max_relative_error"].values()) for r in rows)
    if args.max_error is not None and worst > args.max_error:
        raise SystemExit(f"a variant differs from the loop by {worst:.1e} > {args.max_error:g}")
    return rows


if __name__ == "__main__":
    main()

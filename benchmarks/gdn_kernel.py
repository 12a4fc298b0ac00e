"""The torch gated-delta-rule kernel (``usp.linear.kernel.chunk_gated_delta_rule``)
against transformers' ``torch_chunk_gated_delta_rule`` on CPU: forward + backward, the
same inputs, repeats interleaved (this VM moves single runs by 2x), best of each, ratio.

    python benchmarks/gdn_kernel.py --seq-len 2048 --heads 4 --dim 64 --threads 1
"""

from __future__ import annotations

import argparse
import time


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4, help="value heads (= key heads here)")
    p.add_argument("--dim", type=int, default=64, help="key and value head dim")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    args = p.parse_args(argv)
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from usp.linear.kernel import chunk_gated_delta_rule

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq_len, args.heads)
    q, k, v = (torch.randn(*shape, args.dim, generator=gen) for _ in range(3))
    g = -torch.rand(*shape, generator=gen)
    beta = torch.rand(*shape, generator=gen)
    dout = torch.randn(*shape, args.dim, generator=gen)

    def run(kernel, **kwargs):
        leaves = [t.clone().requires_grad_(not args.no_backward) for t in (q, k, v, g, beta)]
        out = kernel(*leaves, chunk_size=args.chunk_size, **kwargs)[0]
        if not args.no_backward:
            out.backward(dout)
        return out.detach()

    variants = {
        "usp": lambda: run(chunk_gated_delta_rule, use_qk_l2norm=True),
        "transformers": lambda: run(torch_chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True),
    }
    difference = (variants["usp"]() - variants["transformers"]()).abs().max().item()
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeats):  # interleaved
        for name, fn in variants.items():
            best[name] = min(best[name], _timed(fn))
    row = {**vars(args), **{f"{n}_s": t for n, t in best.items()}}
    row["ratio_usp_over_transformers"] = best["usp"] / best["transformers"]
    row["max_abs_difference"] = difference
    what = "forward" if args.no_backward else "forward+backward"
    print(
        f"gated delta rule {what}, B={args.batch} S={args.seq_len} H={args.heads} "
        f"D={args.dim} chunk {args.chunk_size}, {args.threads} thread(s), float32: usp "
        f"{best['usp'] * 1e3:.1f} ms, transformers {best['transformers'] * 1e3:.1f} ms, "
        f"ratio {row['ratio_usp_over_transformers']:.2f} (max |diff| {difference:.2g})"
    )
    return row


if __name__ == "__main__":
    main()

"""The torch gated-delta-rule kernel (``usp.linear.kernel.chunk_gated_delta_rule``)
against transformers' ``torch_chunk_gated_delta_rule`` on CPU: forward + backward, the
same inputs, repeats interleaved (this VM moves single runs by 2x), best of each, ratio.

    python benchmarks/gdn_kernel.py --seq-len 2048 --heads 4 --dim 64 --threads 1

``--ring-degree R`` times instead what the ring adds to one GDN layer (conv + gated delta
rule, forward + backward) at u1 x rR: one rank's zigzag block of S/R tokens under a
``fake`` process group (collectives return at once: the compute the ring pass adds, not
the wire), against the same block computed alone; and the bytes that rank would send.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/x.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import best_interleaved, ring_pass_cost  # noqa: E402


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
    p.add_argument("--ring-degree", type=int, default=1, help="> 1: the ring pass's cost")
    args = p.parse_args(argv)
    if args.ring_degree > 1:
        return ring_cost(args)
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
    best = best_interleaved(variants, args.repeats)
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


def ring_cost(args) -> dict:
    """One rank's share of a GDN layer at u1 x r``args.ring_degree`` (fake group) against
    the same tokens alone."""
    import torch

    from usp.linear import gated_deltanet_usp

    torch.set_num_threads(args.threads)
    r = args.ring_degree
    local = args.seq_len // r
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, local, args.heads)
    q, k, v = (torch.randn(*shape, args.dim, generator=gen) for _ in range(3))
    g = -torch.rand(*shape, generator=gen)
    beta = torch.rand(*shape, generator=gen)
    ws = [torch.randn(args.heads * args.dim, 4, generator=gen) for _ in range(3)]
    dout = torch.randn(*shape, args.dim, generator=gen)

    def run(plan):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        out = gated_deltanet_usp(*leaves, plan, conv_weights=ws, chunk_size=args.chunk_size)
        if not args.no_backward:
            out.backward(dout)

    best, sent = ring_pass_cost(run, r, args.repeats)
    row = {**vars(args), "ring_s": best["ring"], "alone_s": best["alone"], "bytes_sent": sent}
    row["added_fraction"] = best["ring"] / best["alone"] - 1
    print(
        f"GDN layer at u1 x r{r}, rank 1's {local} of {args.seq_len} tokens, H={args.heads} "
        f"D={args.dim}, conv 4, float32, fwd{'' if args.no_backward else '+bwd'}: "
        f"{best['ring'] * 1e3:.1f} ms with the ring pass, {best['alone'] * 1e3:.1f} ms alone "
        f"(+{row['added_fraction']:.0%}); the rank sends {sent / 1e6:.3f} MB (forward and backward)"
    )
    return row


if __name__ == "__main__":
    main()

"""usp's Mamba-2 scan (``usp.linear.mamba2_usp`` in one process, no conv: the chunked
scalar-decay scan and the D skip) against transformers' torch ``mamba2_chunk_scan``
(Bamba's) on CPU: forward + backward, the same inputs, repeats interleaved (this VM moves
single runs by 2x), best of each, ratio.

    python benchmarks/mamba2_kernel.py --seq-len 2048 --heads 8 --head-dim 64 --state 64

``--ring-degree R`` times instead what the ring adds to one Mamba-2 layer's conv + scan
(forward + backward) at u1 x rR: one rank's zigzag block of S/R tokens under a ``fake``
process group (collectives return at once: the compute the ring pass adds, not the
wire), against the same block computed alone; and the bytes that rank would send.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/x.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import best_interleaved, ring_pass_cost  # noqa: E402


def _inputs(args, seq_len, conv_width):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    heads, groups = args.heads, args.groups
    x = torch.randn(args.batch, seq_len, heads, args.head_dim, generator=gen)
    b, c = (torch.randn(args.batch, seq_len, groups, args.state, generator=gen) for _ in "bc")
    dt = F.softplus(torch.randn(args.batch, seq_len, heads, generator=gen) - 1)
    a = -torch.rand(heads, generator=gen) * 2 - 0.1
    d = torch.randn(heads, generator=gen)
    channels = heads * args.head_dim + 2 * groups * args.state
    weight = torch.randn(channels, conv_width, generator=gen) * (0.5 if conv_width > 1 else 1)
    dout = torch.randn(args.batch, seq_len, heads, args.head_dim, generator=gen)
    return [x, b, c, dt, a, d], weight, dout


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64, help="P")
    p.add_argument("--groups", type=int, default=1, help="B/C groups")
    p.add_argument("--state", type=int, default=64, help="N")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--ring-degree", type=int, default=1, help="> 1: the ring pass's cost")
    args = p.parse_args(argv)
    if args.ring_degree > 1:
        return ring_cost(args)
    import torch
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    from usp.linear import mamba2_usp

    torch.set_num_threads(args.threads)
    inputs, identity, dout = _inputs(args, args.seq_len, 1)  # a conv of width 1: none
    identity = torch.ones_like(identity)

    def run(kernel):
        leaves = [t.clone().requires_grad_(not args.no_backward) for t in inputs]
        out = kernel(*leaves)
        if not args.no_backward:
            out.backward(dout)
        return out.detach()

    def usp_scan(x, b, c, dt, a, d):
        return mamba2_usp(x, b, c, dt, a, None, d=d, conv_weight=identity, activation=None,
                          chunk_size=args.chunk_size)  # fmt: skip

    def transformers_scan(x, b, c, dt, a, d):
        return mamba2_chunk_scan(x, dt, a, b, c, chunk_size=args.chunk_size, D=d)

    variants = {"usp": lambda: run(usp_scan), "transformers": lambda: run(transformers_scan)}
    difference = (variants["usp"]() - variants["transformers"]()).abs().max().item()
    best = best_interleaved(variants, args.repeats)
    row = {**vars(args), **{f"{n}_s": t for n, t in best.items()}}
    row["ratio_usp_over_transformers"] = best["usp"] / best["transformers"]
    row["max_abs_difference"] = difference
    what = "forward" if args.no_backward else "forward+backward"
    print(
        f"Mamba-2 scan {what}, B={args.batch} S={args.seq_len} H={args.heads} "
        f"P={args.head_dim} G={args.groups} N={args.state} chunk {args.chunk_size}, "
        f"{args.threads} thread(s), float32: usp {best['usp'] * 1e3:.1f} ms, transformers "
        f"{best['transformers'] * 1e3:.1f} ms, ratio {row['ratio_usp_over_transformers']:.2f} "
        f"(max |diff| {difference:.2g})"
    )
    return row


def ring_cost(args) -> dict:
    """One rank's share of a Mamba-2 layer's conv + scan at u1 x r``args.ring_degree``
    (fake group) against the same tokens alone."""
    import torch

    from usp.linear import mamba2_usp

    torch.set_num_threads(args.threads)
    r = args.ring_degree
    local = args.seq_len // r
    inputs, weight, dout = _inputs(args, local, 4)

    def run(plan):
        leaves = [t.clone().requires_grad_() for t in inputs]
        x, b, c, dt, a, d = leaves
        out = mamba2_usp(x, b, c, dt, a, plan, d=d, conv_weight=weight,
                         chunk_size=args.chunk_size)  # fmt: skip
        if not args.no_backward:
            out.backward(dout)

    best, sent = ring_pass_cost(run, r, args.repeats)
    row = {**vars(args), "ring_s": best["ring"], "alone_s": best["alone"], "bytes_sent": sent}
    row["added_fraction"] = best["ring"] / best["alone"] - 1
    print(
        f"Mamba-2 layer (conv 4 + scan) at u1 x r{r}, rank 1's {local} of {args.seq_len} "
        f"tokens, H={args.heads} P={args.head_dim} N={args.state}, float32, "
        f"fwd{'' if args.no_backward else '+bwd'}: {best['ring'] * 1e3:.1f} ms with the ring "
        f"pass, {best['alone'] * 1e3:.1f} ms alone (+{row['added_fraction']:.0%}); the rank "
        f"sends {sent / 1e6:.3f} MB (forward and backward)"
    )
    return row


if __name__ == "__main__":
    main()

"""USP attention on several processes, checked against single-process attention.

    torchrun --nproc-per-node 4 examples/usp_attention_demo.py --config examples/configs/cpu_demo.toml

Builds the topology from the config, shards one long random sequence over the
sequence-parallel ranks, runs ``usp.usp_attention`` forward and backward, gathers the
results, compares them on rank 0 with plain attention over the whole sequence, and
prints the errors and the bytes each rank moved. Exits non-zero if an error is above
tolerance. Runs on CPU (gloo) by default; ``--device cuda`` uses NCCL and one GPU per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import usp


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/configs/cpu_demo.toml")
    parser.add_argument("--seq-len", type=int, default=2048, help="global tokens (default 2048)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    return parser.parse_args()


def reference(q, k, v, dout, causal):
    """Plain attention over the whole sequence (one process), with autograd."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(groups, 2).transpose(1, 2),
        v.repeat_interleave(groups, 2).transpose(1, 2),
        is_causal=causal,
    ).transpose(1, 2)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def main():
    args = parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        )
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    config = usp.load_config(args.config)
    topo = usp.build_topology_from_config(config)
    options = config.attention
    model = config.model
    heads, kv_heads = (model.num_heads, model.num_kv_heads) if model else (8, 2)
    head_dim = model.head_dim if model and model.head_dim else 64
    if rank == 0:
        print(
            f"world {dist.get_world_size()}: ulysses {topo.ulysses_degree} x ring {topo.ring_degree} "
            f"x dp {topo.dp_degree}; {heads} heads / {kv_heads} KV heads of dim {head_dim}; "
            f"{args.seq_len} tokens, {args.dtype}, causal={args.causal}, layout={options.layout}, "
            f"ring_impl={options.ring_impl}, backend={options.backend}"
        )
    print(topo.describe(), flush=True)

    multiple = usp.sequence_multiple(topo, options.layout)
    if args.seq_len % multiple:
        sys.exit(f"--seq-len must be a multiple of {multiple} for this topology and layout")
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(1234 + topo.dp_rank)  # same sequence on every SP rank
    shape_q = (args.batch, args.seq_len, heads, head_dim)
    shape_kv = (args.batch, args.seq_len, kv_heads, head_dim)
    q, k, v, dout = (
        torch.randn(s, generator=gen).to(device) for s in (shape_q, shape_kv, shape_kv, shape_q)
    )

    dtype = getattr(torch, args.dtype)
    local = [
        usp.shard_sequence(t, topo, layout=options.layout).to(dtype).requires_grad_()
        for t in (q, k, v)
    ]
    topo.comm_stats.reset()
    out = usp.usp_attention(
        *local,
        topo,
        causal=args.causal,
        layout=options.layout,
        ring_impl=options.ring_impl,
        backend=options.backend,
    )
    out.backward(usp.shard_sequence(dout, topo, layout=options.layout).to(dtype))
    gathered = [
        usp.gather_sequence(t, topo, layout=options.layout)
        for t in (out.detach(), *(x.grad for x in local))
    ]
    traffic = [None] * dist.get_world_size()
    dist.all_gather_object(traffic, topo.comm_stats.snapshot())

    failed = False
    if rank == 0:
        expected = reference(q, k, v, dout, args.causal)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        for name, actual, ref in zip(("out", "dq", "dk", "dv"), gathered, expected):
            err = ((actual.float() - ref).abs().max() / ref.abs().max()).item()
            failed |= err > tolerance
            print(f"  {name}: max relative error {err:.2e} (tolerance {tolerance:.0e})")
        for r, snapshot in enumerate(traffic):
            moved = (
                ", ".join(
                    f"{kind} {c['sent'] / 2**20:.2f} MiB sent / {c['received'] / 2**20:.2f} MiB received"
                    for kind, c in snapshot.items()
                )
                or "nothing"
            )
            print(f"  rank {r} moved: {moved}")
        print("FAILED" if failed else "OK: USP attention matches single-process attention")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""USP attention on several processes, checked against single-process attention.

    torchrun --nproc-per-node 4 examples/usp_attention_demo.py --config examples/configs/cpu_demo.toml

Builds the topology from the config (the launch must match its [cluster] section, or the
section says "auto"), shards one long random sequence over the sequence-parallel ranks,
runs USP attention forward and backward, gathers the results, compares them on rank 0
with plain attention over the whole sequence, and prints the errors and the bytes each
rank moved. Exits non-zero if an error is above tolerance. Runs on CPU (gloo) by default;
``--device cuda`` uses NCCL and one GPU per rank.

Shutdown: the topology is used as a context manager; leaving the block synchronises
every rank before the groups are destroyed, so no rank tears its connections down while
another still computes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import usp
from usp.comm.stats import KINDS


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


def gather_traffic(
    stats: usp.comm.stats.CommStats, device: torch.device
) -> list[dict[str, tuple[int, int]]]:
    """Every rank's bytes sent/received per collective kind, with one tensor all-gather
    (object collectives would pickle through numpy on CPU)."""
    mine = torch.tensor(
        [[stats.sent[kind], stats.received[kind]] for kind in KINDS], dtype=torch.int64
    ).to(device)  # [kinds, 2]
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [
        {
            kind: (sent, received)
            for kind, (sent, received) in zip(KINDS, t.tolist())
            if sent or received
        }
        for t in everyone
    ]


def main():
    args = parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        )
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        config = usp.load_config(args.config)
        topo = usp.build_topology_from_config(config)
    except (usp.ConfigError, usp.TopologyError) as e:
        # raised on every rank alike (a config that contradicts the launch, bad degrees)
        print(f"rank {dist.get_rank()}: error: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(2)
    with topo:  # leaving the block synchronises every rank, then destroys the groups
        failed = run(args, config, topo)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def run(args, config, topo) -> bool:
    """The demo proper; True when an error is above tolerance (on rank 0)."""
    plan = usp.Plan.from_config(config, topology=topo)  # the config's [attention] on topo
    model = config.model
    heads, kv_heads = (model.num_heads, model.num_kv_heads) if model else (8, 2)
    head_dim = model.head_dim if model and model.head_dim else 64
    rank = topo.rank
    if rank == 0:
        print(
            f"world {topo.world_size} on {topo.rank_map.describe_nodes()}: ulysses "
            f"{topo.ulysses_degree} x ring {topo.ring_degree} x dp {topo.dp_degree}; {heads} "
            f"heads / {kv_heads} KV heads of dim {head_dim}; {args.seq_len} tokens, {args.dtype}, "
            f"causal={args.causal}, layout={plan.layout}, ring_impl={plan.ring_impl}, "
            f"backend={plan.backend}"
        )
    print(topo.describe(), flush=True)

    if args.seq_len % plan.sequence_multiple:
        # every rank fails the same way, before any collective
        raise SystemExit(
            f"--seq-len must be a multiple of {plan.sequence_multiple} for this topology and layout"
        )
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(1234 + topo.dp_rank)  # same sequence on every SP rank
    shape_q = (args.batch, args.seq_len, heads, head_dim)
    shape_kv = (args.batch, args.seq_len, kv_heads, head_dim)
    q, k, v, dout = (
        torch.randn(s, generator=gen).to(device) for s in (shape_q, shape_kv, shape_kv, shape_q)
    )

    dtype = getattr(torch, args.dtype)
    local = [plan.shard(t).to(dtype).requires_grad_() for t in (q, k, v)]  # [B, S/P, H, D]
    topo.comm_stats.reset()
    out = plan.attention(*local, causal=args.causal)
    out.backward(plan.shard(dout).to(dtype))
    gathered = [plan.gather(t) for t in (out.detach(), *(x.grad for x in local))]  # [B, S, H, D]
    traffic = gather_traffic(topo.comm_stats, device)

    failed = False
    if rank == 0:
        expected = reference(q, k, v, dout, args.causal)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        for name, actual, ref in zip(("out", "dq", "dk", "dv"), gathered, expected):
            err = ((actual.float() - ref).abs().max() / ref.abs().max()).item()
            failed |= err > tolerance
            print(f"  {name}: max relative error {err:.2e} (tolerance {tolerance:.0e})")
        for r, kinds in enumerate(traffic):
            moved = (
                ", ".join(
                    f"{kind} {sent / 2**20:.2f} MiB sent / {received / 2**20:.2f} MiB received"
                    for kind, (sent, received) in kinds.items()
                )
                or "nothing"
            )
            print(f"  rank {r} moved: {moved}")
        print("FAILED" if failed else "OK: USP attention matches single-process attention")
    return failed


if __name__ == "__main__":
    main()

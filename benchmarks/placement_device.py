"""One rank's attention layer on a mixed-length packed row, both token placements, on a
device: the GPU check's ``placement`` step (it has not run on a GPU yet).

    python benchmarks/placement_device.py --device auto            # cuda when there is one
    python benchmarks/placement_device.py --device cpu --seq-len 512 --heads 4 --kv-heads 2 --head-dim 16

One process is a rank of a fake world of ``ulysses x ring`` ranks (PyTorch's ``fake``
process-group backend: collectives return at once, so the time is the rank's kernels
and host work, not its links). The row is the one of the most documents among the first 50
rows of ``--seq-len`` tokens packed from the fine-tuning mix of
``benchmarks/length_mix.py`` (documents padded to the sequence multiple). For each grid and placement the script times forward + backward of one
``plan.attention`` call on the rank with the most work under ``"documents"`` and on rank
0 (the median of ``--repeats`` after a warm-up; on CUDA with events) and counts its
bytes (``comm_stats``), which must equal :func:`usp.planner.placement.row_bytes` of the
row's placement for a one-layer model of these heads: the script exits 1 when they do
not. Under ``"sequence"`` a short document is cut into pieces of ``n / P`` tokens, each
its own varlen segment; under ``"documents"`` it is one segment on one rank: the ratio
of the two times is the kernels' side of the placement's gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import usp  # noqa: E402
from benchmarks.length_mix import lengths as mix_lengths  # noqa: E402
from usp.planner.placement import pack_lengths, place_row, row_bytes  # noqa: E402
from usp.process_groups.fake import fake_world  # noqa: E402
from usp.sp.assignment import DocumentCost  # noqa: E402
from usp.sp.sharding import required_multiple  # noqa: E402


def mixed_row(seq_len: int, ulysses: int, ring: int, scale: int = 1) -> list[int]:
    multiple = required_multiple(ring, ulysses, "zigzag")
    lengths = [max(1, n // scale) for n in mix_lengths("finetune", 4000)]
    rows = pack_lengths(lengths, seq_len, multiple)
    return max(rows[:50], key=len)  # of the first rows, the one of the most documents


def time_call(plan, packed, shapes, device, dtype, repeats: int) -> float:
    heads, kv_heads, dim = shapes
    n = packed.token_indices.numel()  # this rank's tokens, either placement
    gen = torch.Generator().manual_seed(0)

    def tensor(h):
        return torch.randn(1, n, h, dim, generator=gen).to(device, dtype)

    q, k, v = (tensor(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    dout = tensor(heads)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = plan.attention(q, k, v, causal=True, packed=packed)
        torch.autograd.grad(out, (q, k, v), dout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call is the warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_grid(ulysses, ring, seq_len, shapes, device, dtype, repeats, scale=1) -> list[dict]:
    lengths = mixed_row(seq_len, ulysses, ring, scale)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cost = DocumentCost()
    sp = ulysses * ring
    busiest = max(
        range(sp),
        key=lambda s: place_row(
            lengths, "documents", ring=ring, ulysses=ulysses, layout="zigzag", cost=cost
        ).work[s],
    )
    model = types.SimpleNamespace(num_attention_heads=shapes[0], num_key_value_heads=shapes[1],
                                  attention_head_dim=shapes[2], num_hidden_layers=1,
                                  layer_types=None)  # fmt: skip
    rows = []
    for rank in sorted({0, busiest}):
        with fake_world(sp, rank, device):
            topo = usp.build_topology(ulysses, ring, ranks_per_node=min(sp, 8))
            for placement in ("sequence", "documents"):
                plan = usp.Plan(topo, placement=placement, placement_cost=cost)
                packed = plan.pack(cu, device=device)
                topo.comm_stats.reset()
                seconds = time_call(plan, packed, shapes, device, dtype, repeats)
                sent = topo.comm_stats.total_sent // (repeats + 1)
                row = place_row(lengths, placement, ring=ring, ulysses=ulysses, layout="zigzag",
                                cost=cost)  # fmt: skip
                item = torch.tensor([], dtype=dtype).element_size()
                expected = sum(row_bytes(row, model, ring=ring, ulysses=ulysses, layout="zigzag",
                                         ring_impl="p2p", item_bytes=item)[rank].values())  # fmt: skip
                rows.append({
                    "grid": f"u{ulysses}xr{ring}", "rank": rank, "placement": placement,
                    "tokens": packed.token_indices.numel(),
                    "ms": seconds * 1e3, "bytes": sent, "formula_bytes": expected,
                    "documents": len(lengths), "split": len(row.split_lengths),
                })  # fmt: skip
            topo.destroy()
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda, cpu")
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--grids", nargs="+", default=["1x8", "8x1"], help="ULYSSESxRING")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--length-scale",
        type=int,
        default=1,
        help="divide the mix's lengths by this (tiny CPU runs)",
    )
    parser.add_argument("--out", help="a directory for placement_device.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = (args.heads, args.kv_heads, args.head_dim)
    rows = []
    for grid in args.grids:
        ulysses, ring = (int(x) for x in grid.split("x"))
        rows += measure_grid(ulysses, ring, args.seq_len, shapes, device, dtype, args.repeats,
                             args.length_scale)  # fmt: skip
    for r in rows:
        print(f"{r['grid']} rank {r['rank']:>2} {r['placement']:<9} {r['tokens']:>8,} tokens "
              f"{r['ms']:>9.2f} ms {r['bytes'] / 1e6:>9.2f} MB sent (formula "
              f"{r['formula_bytes'] / 1e6:.2f}); {r['split']} of {r['documents']} documents split")  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "placement_device.json").write_text(json.dumps(rows, indent=2))
    wrong = [r for r in rows if r["bytes"] != r["formula_bytes"]]
    if wrong:
        print(f"bytes differ from the formula: {wrong}", file=sys.stderr)
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()

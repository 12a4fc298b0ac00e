"""The tiled MLP as ``usp plan`` measures it: forward + backward under fake tensors.

    python benchmarks/mlp_fake.py      # Llama-3.1-8B's MLP, 131,072 tokens, tiles of 8192
    python benchmarks/mlp_fake.py --tokens 4096 --dim 64 --intermediate 224 --tile 512

One ``usp.models.mlp.MLP`` (bf16 weights, tiled by ``tile_mlp(mlp, --tile)``) runs forward and
backward on a fake ``[1, tokens, dim]`` input under ``FakeTensorMode``, counted by
torch's ``MemTracker`` (the planner's tools; nothing is computed or allocated). Rows:
with and without :func:`usp.models.tiling.representative_tiles` (the first and the
last tile only), each plain and under a non-reentrant checkpoint of the whole MLP (as
the layer checkpoint runs it): the median seconds of ``--repeats`` runs after one
warm-up, and the tracker's peak bytes (input, output gradient and weights included).
The peaks of a row pair must be equal (the loop is memory-periodic); the times are the
host's and vary with the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from usp.models import LlamaConfig
from usp.models.levers import tile_mlp
from usp.models.mlp import MLP
from usp.models.tiling import representative_tiles

GIB = 2**30


def run_once(args, *, representative: bool, layer_checkpoint: bool) -> tuple[float, int]:
    """(seconds, peak bytes) of one fake forward + backward."""
    with FakeTensorMode():
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=args.dim,
            intermediate_size=args.intermediate,
            num_hidden_layers=1,
            num_attention_heads=8,
        )
        mlp = MLP(config)
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # (no .to() of fakes)
            linear.weight = torch.nn.Parameter(linear.weight.to(torch.bfloat16))
        tile_mlp(mlp, args.tile)
        x = torch.randn(1, args.tokens, args.dim, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, args.tokens, args.dim, dtype=torch.bfloat16)
        tracker = MemTracker()
        tracker.track_external(mlp, x, grad)
        start = time.perf_counter()
        with tracker, representative_tiles() if representative else nullcontext():
            out = checkpoint(mlp, x, use_reentrant=False) if layer_checkpoint else mlp(x)
            out.backward(grad)
        seconds = time.perf_counter() - start
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return seconds, peak


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072, help="local tokens (S/P)")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--tile", type=int, default=8192, help="mlp_tile_tokens")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for layer_checkpoint in (False, True):
        for representative in (True, False):
            options = {"representative": representative, "layer_checkpoint": layer_checkpoint}
            run_once(args, **options)  # warm-up
            runs = [run_once(args, **options) for _ in range(args.repeats)]
            rows.append(
                {**options, "seconds": statistics.median(s for s, _ in runs), "peak": runs[0][1]}
            )
    tiles = -(-args.tokens // args.tile)
    print(f"fake bf16 MLP {args.dim} x {args.intermediate}, {args.tokens} tokens, "
          f"{tiles} tiles of {args.tile}:")  # fmt: skip
    for row in rows:
        label = ("layer checkpoint, " if row["layer_checkpoint"] else "") + (
            "first and last tile" if row["representative"] else "every tile"
        )
        print(f"  {label:>37}: {row['seconds'] * 1000:7.1f} ms, "
              f"peak {row['peak'] / GIB:.4f} GiB ({row['peak']:,} B)")  # fmt: skip
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

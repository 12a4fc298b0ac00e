"""benchmarks/host_overhead.py at tiny size: rows for every grid, dense and packed, with
consistent times and the kernel calls the ring makes (in this process, under the fake
process-group backend; no default group before or after)."""

from __future__ import annotations

import math

import torch.distributed as dist
from usp_cases import load_benchmark

host_overhead = load_benchmark("host_overhead")


def test_host_overhead_rows():
    assert not dist.is_initialized()
    rows = host_overhead.main(["--repeats", "2", "--warmup", "1", "--grids", "8x1", "1x8"])
    assert not dist.is_initialized(), "the fake world must be torn down"
    assert [(r["ulysses"], r["ring"], r["packed"]) for r in rows] == [
        (8, 1, False), (1, 8, False), (8, 1, True), (1, 8, True),
    ]  # fmt: skip
    for row in rows:
        assert math.isfinite(row["total_ms"]) and row["total_ms"] > 0
        assert 0 < row["kernel_ms"] < row["total_ms"]
        assert math.isclose(row["overhead_ms"], row["total_ms"] - row["kernel_ms"])
        assert 0 < row["best_overhead_ms"] <= row["total_ms"]
    dense = {(r["ulysses"], r["ring"]): r["kernel_calls"] for r in rows if not r["packed"]}
    # causal zigzag p2p, one forward and one backward kernel call per block: a ring of one
    # makes one block; a ring of 8 makes one block at each of its 8 steps
    assert dense == {(8, 1): 2, (1, 8): 16}
    packed = [r for r in rows if r["packed"]]
    assert all(p["kernel_calls"] > dense[(p["ulysses"], p["ring"])] for p in packed)

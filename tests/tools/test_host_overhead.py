"""benchmarks/host_overhead.py at tiny size: rows for every grid, dense and packed, with
consistent times and the kernel calls the ring makes (in this process, under the fake
process-group backend; no default group before or after)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from usp_cases import load_benchmark

host_overhead = load_benchmark("host_overhead")


def test_host_overhead_rows(tmp_path):
    assert not dist.is_initialized()
    rows = host_overhead.main(
        ["--repeats", "2", "--warmup", "1", "--grids", "8x1", "1x8", "--out", str(tmp_path)]
    )
    assert not dist.is_initialized(), "the fake world must be torn down"
    saved = json.loads((tmp_path / "host_overhead.json").read_text())
    assert saved["rows"] == rows and "backend cpu" in saved["setup"]
    assert all(row["device_ms"] is None for row in rows)  # GPU time: on CUDA only
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
    # host work per layer call, as aten ops outside the kernels (forward + backward): a
    # count, so it can be asserted where a time could not. Measured on torch 2.13: 108 /
    # 160 dense and 362 / 1308 packed at u8 x r1 / u1 x r8 (the ring's were 279 and 2678
    # while each block made its own views and a merge took 13 ops, and each document of
    # a packed block took the batch dimension off and put it back). The budgets leave
    # less than one op per ring merge or per kernel call of a packed layer call (12 and
    # 68: documents of one length run as one call), so either coming back fails.
    budgets = {(8, 1, False): 110, (1, 8, False): 165, (8, 1, True): 370, (1, 8, True): 1350}
    for row in rows:
        case = (row["ulysses"], row["ring"], row["packed"])
        assert row["aten_ops"] <= budgets[case], (case, row["aten_ops"], budgets[case])


def test_cuda_without_a_gpu_is_refused_with_the_reason(capsys):
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    with pytest.raises(SystemExit) as exit_info:
        host_overhead.main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda needs a CUDA GPU visible to torch" in capsys.readouterr().err


def test_device_auto_without_a_gpu_and_another_backend(tmp_path):
    """``--device auto`` (what gpu_check.sh passes) runs on the CPU where there is no GPU;
    ``--backend math`` is the backend every kernel call goes to."""
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here: auto would pick it")
    argv = ["--device", "auto", "--backend", "math", "--grids", "8x1", "--repeats", "1"]
    rows = host_overhead.main([*argv, "--warmup", "0", "--out", str(tmp_path)])
    setup = json.loads((tmp_path / "host_overhead.json").read_text())["setup"]
    assert "float32" in setup and ", cpu, backend math," in setup
    # a ring of one: one forward and one backward call, dense; packed: per group of
    # documents of one length (the math backend has no varlen kernel either)
    assert [r["kernel_calls"] for r in rows] == [2, 12]
    assert all(r["device_ms"] is None for r in rows)


def test_compiled_rows_beside_eager_ones(tmp_path):
    """``--compile``: each case eager, then compiled (fullgraph; here AOT autograd without
    code generation, to be quick), the same kernel calls, the compile time recorded."""
    argv = ["--compile", "--compile-backend", "aot_eager", "--grids", "1x8"]
    rows = host_overhead.main([*argv, "--repeats", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert [(r["packed"], r["compiled"]) for r in rows] == [
        (False, False), (False, True), (True, False), (True, True),
    ]  # fmt: skip
    saved = json.loads((tmp_path / "host_overhead.json").read_text())
    assert "compiled: torch.compile(fullgraph=True, backend='aot_eager')" in saved["setup"]
    for eager, compiled in (rows[:2], rows[2:]):
        assert compiled["kernel_calls"] == eager["kernel_calls"]  # 16 dense, 68 packed
        assert compiled["compile_s"] > 0 and eager["compile_s"] is None
        assert compiled["aten_ops"] is None and eager["aten_ops"] > 0
        assert 0 < compiled["kernel_ms"] < compiled["total_ms"]

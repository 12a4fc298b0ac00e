"""benchmarks/moe_experts.py at its tiny shape: the variants agree (float32: the loop, the
sorted segments and torch's grouped GEMM; float64: no grouped GEMM) and every time and
ratio is there and positive."""

from __future__ import annotations

from benchmarks import moe_experts as bench


def test_moe_experts_benchmark_at_a_tiny_shape(tmp_path):
    (row,) = bench.main(["--shapes", "tiny", "--repeats", "2", "--threads", "2",
                         "--out", str(tmp_path)])  # fmt: skip
    assert set(row["max_relative_error"]) == {"loop", "segments", "grouped"}
    assert max(row["max_relative_error"].values()) <= 1e-6
    assert len(row["ms"]) == 6 and all(v > 0 for v in row["ms"].values())
    assert len(row["ratios"]) == 4 and all(v > 0 for v in row["ratios"].values())
    assert (tmp_path / "moe_experts.json").is_file()
    (double,) = bench.main(["--shapes", "tiny", "--repeats", "1", "--dtype", "float64"])
    assert set(double["ratios"]) == {"loop / segments forward", "loop / segments forward_backward"}
    assert max(double["max_relative_error"].values()) <= 1e-14


def test_moe_experts_benchmark_fails_beyond_its_max_error():
    """gpu_check.sh's moe_experts step fails when a variant differs from the loop (here a
    bound no result can meet); --device auto is the CPU without a GPU."""
    import pytest

    with pytest.raises(SystemExit, match="differs from the loop by .* > -1"):
        bench.main(["--shapes", "tiny", "--repeats", "1", "--device", "auto", "--forward-only",
                    "--max-error", "-1"])  # fmt: skip

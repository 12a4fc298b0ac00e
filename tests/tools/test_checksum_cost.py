"""benchmarks/checksum_cost.py at a tiny size: every measurement is there and positive (the
speeds themselves are measured, never asserted)."""

from __future__ import annotations

import math

from usp_cases import load_benchmark

checksum_cost = load_benchmark("checksum_cost")


def test_checksum_cost_measures_save_load_and_both_checksums(tmp_path, capsys):
    seconds = checksum_cost.main(
        ["--mb", "40", "--threads", "1", "2", "--repeats", "2", "--dir", str(tmp_path)]
    )
    expected = {
        "dcp.save",
        "dcp.load from disk",
        "xxh3_64 of 256 MB in memory, one thread",
        "crc32 of 256 MB in memory, one thread",
        "sha256 of 256 MB in memory, one thread",
    }
    for threads in (1, 2):
        expected |= {
            f"record_checksums x{threads}",
            f"verify_checksums x{threads} + dcp.load from disk",
        }
    assert set(seconds) == expected
    assert all(math.isfinite(s) and s > 0 for s in seconds.values()), seconds
    out = capsys.readouterr().out
    assert "median (range) over 2 rounds: record x1 / save: " in out, out
    assert "verify x2 + load / load - 1: " in out, out
    assert list(tmp_path.iterdir()) == [], "its files are removed"

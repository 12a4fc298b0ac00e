"""benchmarks/checksum_cost.py at a tiny size: every measurement is there and positive (the
speeds themselves are measured, never asserted)."""

from __future__ import annotations

import math

from usp_cases import load_benchmark

checksum_cost = load_benchmark("checksum_cost")


def test_checksum_cost_measures_save_load_and_both_checksums(tmp_path, capsys):
    seconds = checksum_cost.main(
        ["--mb", "40", "--threads", "1", "2", "--repeats", "1", "--dir", str(tmp_path)]
    )
    expected = {"dcp.save", "dcp.load (page cache)", "dcp.load (from disk)"}
    for threads in (1, 2):
        expected |= {
            f"record_checksums x{threads} (after the save)",
            f"verify_checksums x{threads} (page cache)",
            f"verify_checksums x{threads} + dcp.load (from disk)",
        }
    assert set(seconds) == expected
    assert all(math.isfinite(s) and s > 0 for s in seconds.values()), seconds
    out = capsys.readouterr().out
    assert "the checksums add" in out and "crc32" in out and "sha256" in out, out
    assert list(tmp_path.iterdir()) == [], "its files are removed"

"""benchmarks/placement_device.py (the GPU check's ``placement`` step) on CPU at tiny
sizes: both placements on one rank of a fake 4-rank world, the bytes it counts equal to
the formula (the script exits 1 otherwise), and "documents" computing short documents whole."""

from __future__ import annotations

import json

import torch.distributed as dist

from benchmarks import placement_device


def test_both_placements_are_timed_and_counted(tmp_path):
    assert not dist.is_initialized()
    rows = placement_device.main(
        ["--device", "cpu", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--grids", "2x2", "--repeats", "1", "--length-scale", "32",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert not dist.is_initialized()
    assert {r["placement"] for r in rows} == {"sequence", "documents"}
    for r in rows:
        assert r["bytes"] == r["formula_bytes"] and r["ms"] > 0
        if r["placement"] == "sequence":
            assert r["split"] == r["documents"] and r["tokens"] == 512
        else:  # short documents: some (here all) computed whole
            assert r["split"] < r["documents"]
    assert json.loads((tmp_path / "placement_device.json").read_text()) == rows

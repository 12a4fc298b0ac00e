"""benchmarks/cuda_graph_check.py (gpu_check.sh's ``cuda_graph`` step) on the CPU: the
same cases without CUDA graphs, checked the same way (the exact cases against eager, a
failed case failing the script), and refused with the reason for ``--device cuda``
without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from usp_cases import load_benchmark

cuda_graph_check = load_benchmark("cuda_graph_check")


def test_the_cases_run_and_are_checked_on_the_cpu(tmp_path):
    argv = ["--device", "cpu", "--compile-backend", "aot_eager", "--repeats", "1"]
    rows = cuda_graph_check.main([*argv, "--cases", "2", "--out", str(tmp_path)])
    assert [r["case"] for r in rows] == ["u1xr1 packed", "u1xr8"]
    exact, ring = rows
    assert exact["exact"] and exact["error"] <= 1e-5
    assert not ring["exact"] and "error" not in ring  # a fake ring's buffers hold garbage
    assert all(r["captured"] is None and r["compiled_ms"] > 0 for r in rows)  # no CUDA here
    saved = json.loads((tmp_path / "cuda_graph.json").read_text())
    assert saved["verdict"] == "all ok" and saved["setup"]["backend"] == "cpu"


def test_a_case_beyond_the_tolerance_fails_the_script(capsys):
    argv = ["--device", "cpu", "--compile-backend", "aot_eager", "--repeats", "1"]
    with pytest.raises(SystemExit) as exit_info:
        cuda_graph_check.main([*argv, "--cases", "1", "--tol", "-1"])
    assert exit_info.value.code == 1
    assert "FAILED: u1xr1 packed: relative error" in capsys.readouterr().out


def test_cuda_without_a_gpu_is_refused_with_the_reason(capsys):
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    with pytest.raises(SystemExit) as exit_info:
        cuda_graph_check.main([])
    assert exit_info.value.code == 2
    assert "--device cuda needs a CUDA GPU visible to torch" in capsys.readouterr().err

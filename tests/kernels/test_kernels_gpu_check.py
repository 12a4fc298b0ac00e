"""A broken backend fails the GPU check: CPU analogues of each link of the chain.

A backend that drops ``softmax_scale`` (here: ``cpu``, broken on purpose) fails its
self-check (tests/kernels/test_kernels_selfcheck.py), which makes every kernel test of it FAIL
rather than skip, makes ``benchmarks/kernel_bench.py`` report it and exit non-zero, and
a step that exits non-zero makes ``benchmarks/gpu_check.sh`` exit 1 — shown with a fake
Python that fails on command, which also shows that a missing script and an exhausted
time budget are failures, and that the JSON and Markdown summaries are written.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import require

from benchmarks import kernel_bench
from usp.kernels import AttentionSpec, selection, selfcheck
from usp.kernels.backends.cpu import CpuBackend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def broken_cpu_backend(monkeypatch):
    """``cpu`` calling its kernel with head_dim**-0.5 instead of the scale it was given."""
    real_forward = CpuBackend.forward
    monkeypatch.setattr(
        CpuBackend,
        "forward",
        lambda self, q, k, v, spec, scale: real_forward(self, q, k, v, spec, spec.head_dim**-0.5),
    )
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selection, "_reported_skips", set())


BENCH = ["--device", "cpu", "--seqlens", "64", "--head-dim", "32", "--repeats", "1"]


def test_kernel_bench_passes_with_working_backends(tmp_path, monkeypatch):
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    rows = kernel_bench.main([*BENCH, "--out", str(tmp_path)])
    assert kernel_bench.failures(rows) == []
    assert {r["backend"] for r in rows} == {"auto", "cpu", "math"}
    assert rows[0]["dense"] == "cpu"
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved["verdict"] == "all ok" and len(saved["rows"]) == 3


def test_a_broken_backend_fails_the_kernel_tests_and_the_kernel_bench(broken_cpu_backend, tmp_path):
    spec = AttentionSpec(1, 64, 64, 4, 2, 64, torch.float32, torch.device("cpu"), True, None)
    with pytest.raises(pytest.fail.Exception, match="'cpu' must run .* failed its self-check"):
        require("cpu", spec)
    with pytest.warns(RuntimeWarning, match="'cpu' skipped by auto"):
        rows = kernel_bench.main([*BENCH, "--out", str(tmp_path)])
    failed = kernel_bench.failures(rows)
    assert [r["backend"] for r in failed] == ["cpu"]
    assert "unavailable where it must run: failed its self-check" in failed[0]["note"]
    assert "**FAILED**" in (tmp_path / "kernels.md").read_text()
    assert json.loads((tmp_path / "kernels.json").read_text())["verdict"] == "FAILED: cpu"


# ------------------------------------------------------------------ gpu_check.sh
FAKE_PYTHON = """#!/bin/sh
# a stand-in for python: prints its arguments, fails or sleeps when they match
echo "fake python $*"
case "$*" in *"${FAKE_SLEEP_ON:-@none@}"*) sleep "${FAKE_SLEEP_S:-0}" ;; esac
case "$*" in *"${FAKE_FAIL_ON:-@none@}"*) echo "fake failure"; exit 3 ;; esac
exit 0
"""


@pytest.fixture
def check_tree(tmp_path):
    """A copy of gpu_check.sh in a tree with (fake) scripts of its script steps."""
    tree = tmp_path / "repo"
    (tree / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_check.sh", tree / "benchmarks" / "gpu_check.sh")
    for name in (
        "peers.py",
        "train_emulate.py",
        "plan_check.py",
        "overheads_check.py",
        "cuda_graph_check.py",
        "moe_experts.py",
        "placement_device.py",
    ):
        (tree / "benchmarks" / name).write_text("# fake\n")
    python = tmp_path / "fake_python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tree, python


def _run_check(tree, python, **env):
    out = tree / "results"
    result = subprocess.run(
        ["bash", str(tree / "benchmarks" / "gpu_check.sh"), str(out)],
        env={**os.environ, "PYTHON": str(python), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = json.loads((out / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in summary["steps"]}
    return result, summary, statuses, (out / "gpu_check.md").read_text()


STEPS = [
    "environment",
    "kernel_tests",
    "cuda_tests",
    "plan_check",
    "overheads",
    "kernel_bench",
    "emulate",
    "peers",
    "train_emulate",
    "host_overhead",
    "cuda_graph",
    "moe_experts",
    "placement",
]


def test_gpu_check_passes_when_every_step_passes(check_tree):
    result, summary, statuses, md = _run_check(*check_tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(statuses) == STEPS and set(statuses.values()) == {"ok"}
    assert summary["passed"] is True and summary["budget_s"] == 480
    assert "GPU check passed" in result.stdout
    assert "| kernel_bench | ok | 0 |" in md


def test_a_failing_step_fails_the_check_and_the_others_still_run(check_tree):
    result, summary, statuses, md = _run_check(*check_tree, FAKE_FAIL_ON="kernel_bench.py")
    assert result.returncode == 1
    assert statuses["kernel_bench"] == "failed"
    assert {n: s for n, s in statuses.items() if n != "kernel_bench"} == {
        n: "ok" for n in STEPS if n != "kernel_bench"
    }
    assert summary["passed"] is False
    assert "GPU check FAILED" in result.stdout and "kernel_bench (failed)" in result.stdout
    assert "| kernel_bench | failed | 3 |" in md


def test_a_missing_script_is_a_loud_failure(check_tree):
    tree, python = check_tree
    (tree / "benchmarks" / "peers.py").unlink()
    result, _, statuses, _ = _run_check(tree, python)
    assert result.returncode == 1
    assert statuses["peers"] == "missing" and statuses["train_emulate"] == "ok"
    assert "peers: FAILED: benchmarks/peers.py does not exist" in result.stdout


def test_steps_the_budget_leaves_no_time_for_are_failures(check_tree):
    result, summary, statuses, _ = _run_check(
        *check_tree, GPU_CHECK_BUDGET_S="17", FAKE_SLEEP_ON="import os", FAKE_SLEEP_S="3"
    )
    assert result.returncode == 1
    assert statuses["environment"] == "ok"
    assert {statuses[n] for n in STEPS[1:]} == {"not run"}  # 14 s left < 15 s minimum
    assert summary["elapsed_s"] < 17


def test_the_environment_step_fails_without_a_gpu(check_tree, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    tree, _ = check_tree
    real_for_environment = tmp_path / "python_for_environment"
    real_for_environment.write_text(
        f'#!/bin/sh\ncase "$1" in -c) exec "{sys.executable}" "$@" ;; esac\necho fake; exit 0\n'
    )
    real_for_environment.chmod(0o755)
    result, _, statuses, _ = _run_check(tree, real_for_environment)
    assert result.returncode == 1
    assert statuses["environment"] == "failed"
    assert "no CUDA GPU visible to torch: this is the GPU check" in result.stdout
    assert statuses["kernel_tests"] == "ok"  # the fake ran it: every step still runs

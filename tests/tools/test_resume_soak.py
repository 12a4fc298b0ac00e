"""benchmarks/resume_soak.py and benchmarks/exit_race.py without their many launches:
the soak's job is a valid training config for every tiny preset and its comparison of
the resumed steps sees a difference; the exit race runs a pair of ranks that waits (and does
not abort)."""

from __future__ import annotations

import json

import pytest

from benchmarks import exit_race, resume_soak
from usp.train.config import load_train_config


@pytest.mark.parametrize("preset", resume_soak.TINY_PRESETS)
def test_the_soaks_job_is_a_valid_config_of_every_tiny_preset(tmp_path, preset):
    path = tmp_path / "job.toml"
    path.write_text(resume_soak.CONFIG.format(preset=preset))
    job = load_train_config(path, steps=2, ulysses=2, ring=2, dp=1, device="cpu")
    assert job.model.preset == preset and job.train.steps == 2
    assert job.train.min_lr_ratio == 1.0 and job.train.warmup_steps == 0, "a constant lr"


def _metrics(directory, rows):
    directory.mkdir(parents=True)
    keys = ("step", "loss", "aux_loss", "grad_norm")
    lines = [json.dumps(dict(zip(keys, row))) for row in rows]
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_the_soak_compares_the_resumed_steps(tmp_path):
    rows = [(1, 5.0, 0.1, 2.0), (2, 4.0, 0.1, 1.5), (3, 3.5, 0.2, 1.2), (4, 3.0, 0.2, 1.0)]
    _metrics(tmp_path / "full", rows)
    _metrics(tmp_path / "split", rows)
    assert resume_soak._resume_mismatches(tmp_path, 1e-6) == []
    (tmp_path / "split" / "metrics.jsonl").unlink()
    (tmp_path / "split").rmdir()
    _metrics(tmp_path / "split", [*rows[:3], (4, 3.0, 0.2, 1.0 + 1e-5)])
    assert resume_soak._resume_mismatches(tmp_path, 1e-6) == [
        "step 4 grad_norm: 1.00001 resumed != 1.0 uninterrupted"
    ]
    assert resume_soak._grid(4) == ["--ulysses", "2", "--ring", "2", "--dp", "1"]


def test_the_exit_race_runs_a_pair_and_the_wait_leaves_no_rank_aborting(tmp_path):
    """One pair of ranks in the "wait" mode (what usp train's teardown does); the "exit"
    pairs abort only sometimes, so they are the benchmark's to count."""
    result = exit_race.run_pair("wait", 1.0, tmp_path, 0)
    assert result == {"mode": "wait", "statuses": [0, 0], "aborted": False, "failed": False}

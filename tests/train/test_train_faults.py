"""``usp train`` under faults, in-process on 4 gloo ranks (no torchrun): a second job on
one output directory, a damaged ``metrics.jsonl``, non-finite losses, a signal, damaged
or node-local checkpoints, a resume with a changed run, an unwritable output directory.
The non-finite stop and the zero-gradient stop run on 2 ranks (ulysses 2): neither
depends on the grid, and one rank's NaN agreed by all 4 ranks is the skipped-step test's.

Every error case checks that all ranks raise the same message (the harness fails a rank
left in a collective within its timeout). Signals and stalls across processes are in
tests/train/test_train_signals.py (real torchrun launches).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_cases import _train_on_ranks, base_config
from usp_cases import topology

from usp.sp.plan import Plan
from usp.train.config import train_config_from_dict
from usp.train.lock import LOCK_FILE, OutputLock
from usp.train.metrics import MetricsWriter, read_metrics_tolerant
from usp.train.trainer import train

TIMEOUT = 240


def _error_of(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        return f"{type(err).__name__}: {err}"
    return None


def _same_everywhere(messages) -> str:
    assert all(m == messages[0] for m in messages), messages
    assert messages[0] is not None, "no error"
    return messages[0]


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


# ------------------------------------------------------------------ 1. one job per directory
def run_train_error(config, out, resume=False):
    return _error_of(_train_on_ranks, config, 2, 2, out, resume)


def test_a_second_job_on_the_same_output_is_refused_naming_the_holder(distributed, tmp_path):
    out = tmp_path / "run"
    held = OutputLock.acquire(out)  # "the running job": this pytest process
    try:
        for resume in (False, True):
            message = _same_everywhere(
                distributed.run(
                    run_train_error, base_config(), str(out), resume, world_size=4, timeout=60
                )
            )
            assert message.startswith("OutputLockedError"), message
            assert f"pid {os.getpid()}" in message and socket.gethostname() in message, message
            assert "one job per output directory" in message, message
        assert not (out / "metrics.jsonl").exists(), "the refused job wrote nothing"
        assert not (out / "checkpoints").exists()
    finally:
        held.release()
    OutputLock.acquire(out).release()  # released: free again


def test_a_stale_lock_is_taken_over_and_another_hosts_lock_is_not(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "started": "yesterday"}
    (out / LOCK_FILE).write_text(json.dumps(stale))
    stream = io.StringIO()
    config = base_config(steps=1, checkpoint_interval=0)
    train(train_config_from_dict(config), None, output_dir=out, stream=stream)
    assert f"took over the stale lock of a job that is gone (host {socket.gethostname()}, " in (
        stream.getvalue()
    )
    assert f"pid {dead.pid}" in stream.getvalue()
    assert (out / LOCK_FILE).read_text() == "", "released at the end"

    elsewhere = {"host": "node-17.cluster", "pid": 4242, "started": "today"}
    (out / LOCK_FILE).write_text(json.dumps(elsewhere))
    job = train_config_from_dict(base_config(steps=2))
    message = _error_of(train, job, None, output_dir=out, resume=True, stream=io.StringIO())
    assert "OutputLockedError" in message and "node-17.cluster" in message, message
    assert f"delete {out / LOCK_FILE}" in message, message


def test_an_unwritable_output_directory_is_a_start_up_error(distributed, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = _same_everywhere(
        distributed.run(
            run_train_error, base_config(), str(blocker / "run"), world_size=4, timeout=60
        )
    )
    assert "ConfigError" in message and "is not writable" in message, message
    assert "--output" in message, message


def run_with_a_blocked_save(config, out, blocked_step):
    """A file where step ``blocked_step``'s checkpoint directory must go: its save fails
    on every rank (DCP raises its CheckpointException, a BaseException)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        checkpoints = Path(out) / "checkpoints"
        checkpoints.mkdir(parents=True)
        (checkpoints / f"step_{blocked_step:06d}").write_text("in the way")
    dist.barrier()
    message = run_train_error(config, out)
    dist.barrier()  # the default group still works after the failed save
    return message


def test_a_failed_checkpoint_save_is_one_error_on_every_rank(distributed, tmp_path):
    out = tmp_path / "run"
    config = base_config(steps=4, checkpoint_interval=2)
    message = _same_everywhere(
        distributed.run(run_with_a_blocked_save, config, str(out), 4, world_size=4, timeout=120)
    )
    assert message.startswith("CheckpointError: saving the checkpoint"), message
    assert "step_000004 failed (rank(s) 0, 1, 2, 3: FileExistsError" in message, message
    assert "writable from every rank" in message, message
    assert "the newest complete checkpoint is still step_000002" in message, message
    assert "Traceback" not in message, message
    assert _checkpoints(out) == ["step_000002", "step_000004"]  # (the blocker file)
    assert (out / "checkpoints" / "step_000002" / "usp_meta.json").is_file()


# ------------------------------------------------------------------ 2. metrics.jsonl
def test_metrics_rows_are_whole_lines_with_null_for_non_finite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": 2.5, "grad_norm": float("nan")})
    writer.write({"step": 2, "loss": float("inf"), "grad_norm": 1.0})
    writer.close()
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text, text
    rows = [json.loads(line) for line in text.splitlines()]  # strict JSON parses it
    assert rows == [
        {"step": 1, "loss": 2.5, "grad_norm": None},
        {"step": 2, "loss": None, "grad_norm": 1.0},
    ]


def test_a_cut_last_line_is_dropped_on_resume_with_a_warning(sp_faults_run, distributed, tmp_path):
    config, out, uninterrupted = sp_faults_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000004")
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.2')  # a row cut by a crash
    results = distributed.run(_train_logged, config, str(copy), True, world_size=4, timeout=TIMEOUT)
    rows, log = results[0]
    assert [r[0] for r in rows] == [3, 4]
    assert "dropped the last line, which is not a JSON object" in log, log
    assert [r["step"] for r in _rows(copy)] == [1, 2, 3, 4]
    assert rows == uninterrupted[2:]
    assert read_metrics_tolerant(copy / "metrics.jsonl")[1] == []


# ------------------------------------------------------------------ shared run
def _train_logged(config, out, resume=False, resume_changed=False, stop_after=None):
    """The job on the world's ranks: ulysses 2 x ring 2 on 4 (:func:`base_config`), ulysses
    2 on 2 (:func:`two_rank_config`)."""
    job = train_config_from_dict(config)
    grid = (config["parallel"]["ulysses"], config["parallel"]["ring"])
    plan = Plan(topology(*grid), layout=job.topology.attention.layout, verify_calls=False)
    stream = io.StringIO()
    result = train(
        job,
        plan,
        output_dir=out,
        resume=resume,
        resume_changed=resume_changed,
        stop_after=stop_after,
        stream=stream,
    )
    return [(r["step"], r["loss"], r["grad_norm"]) for r in result.metrics], stream.getvalue()


@pytest.fixture(scope="module")
def sp_faults_run(distributed, tmp_path_factory):
    """4 steps, checkpoints at 2 and 4 (kept: both)."""
    out = tmp_path_factory.mktemp("faults_run")
    config = base_config()
    results = distributed.run(_train_logged, config, str(out), world_size=4, timeout=TIMEOUT)
    return config, out, results[0][0]


# ------------------------------------------------------------------ 3. non-finite steps
def two_rank_config(**train) -> dict:
    """:func:`base_config` on 2 ranks (ulysses 2): what a fault does not depend on the
    grid for (a non-finite or zero norm on 2 ranks; the 4-rank agreement on one rank's
    NaN: test_max_skipped_steps_skips_the_update_and_continues)."""
    config = base_config(**train)
    config["cluster"] = {**config["cluster"], "gpus_per_node": 2}
    config["parallel"] = {"ulysses": 2, "ring": 1, "dp": 1}
    return config


def _nan_norm_on(rank_with_nan: int, steps: tuple[int, ...]):
    """Make clip_grad_norm_ report NaN on one rank at the given optimizer steps."""
    original = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def patched(params, max_norm, *args, **kwargs):
        calls["n"] += 1
        norm = original(params, max_norm, *args, **kwargs)
        if calls["n"] in steps and torch.distributed.get_rank() == rank_with_nan:
            return torch.full((), float("nan"))
        return norm

    return original, patched


def run_with_nan_norm(config, out, steps):
    original, patched = _nan_norm_on(1, steps)
    torch.nn.utils.clip_grad_norm_ = patched
    try:
        try:
            rows, log = _train_logged(config, out)
            return rows, log, None
        except Exception as err:  # noqa: BLE001
            return None, None, f"{type(err).__name__}: {err}"
    finally:
        torch.nn.utils.clip_grad_norm_ = original


def test_a_non_finite_step_stops_the_run_on_every_rank(distributed, tmp_path):
    """Rank 1's norm is NaN at step 3 of 2 ranks: both raise the same error."""
    config = two_rank_config(checkpoint_interval=1, keep_checkpoints=1)
    out = tmp_path / "run"
    results = distributed.run(
        run_with_nan_norm, config, str(out), (3,), world_size=2, timeout=TIMEOUT
    )
    message = _same_everywhere([r[2] for r in results])
    assert message.startswith("TrainingDivergedError"), message
    assert "step 3: the loss is" in message and "gradient norm nan" in message, message
    assert "max_skipped_steps = 0" in message and "step_000002" in message, message
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["grad_norm"] is None and rows[2]["skipped"] is True
    assert _checkpoints(out) == ["step_000002"], "the newest finite checkpoint is kept"
    assert not (out / "hf").exists()


def test_max_skipped_steps_skips_the_update_and_continues(distributed, tmp_path, sp_faults_run):
    config = base_config(max_skipped_steps=1)
    results = distributed.run(
        run_with_nan_norm, config, str(tmp_path / "run"), (2,), world_size=4, timeout=TIMEOUT
    )
    rows = results[0][0]
    assert all(str(r[0]) == str(rows) for r in results), "every rank logs the same (NaN too)"
    assert str(rows[1][2]) == "nan", "rank 1's non-finite norm is what every rank logs"
    _, _, uninterrupted = sp_faults_run
    assert rows[0] == uninterrupted[0]
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    assert rows[1][1] == uninterrupted[1][1], "step 2's loss was computed as before"
    assert rows[2][1] != uninterrupted[2][1], "but its update was not applied"
    assert all(torch.isfinite(torch.tensor([r[1], r[2]])).all() for r in (rows[0], *rows[2:]))
    logged = _rows(tmp_path / "run")
    assert [r.get("skipped", False) for r in logged] == [False, True, False, False]


def test_an_overflowing_update_is_never_saved(distributed, tmp_path):
    config = base_config(lr=1e38, grad_clip=0.0, warmup_steps=0, checkpoint_interval=1)
    out = tmp_path / "run"
    message = _same_everywhere(
        distributed.run(run_train_error, config, str(out), world_size=4, timeout=TIMEOUT)
    )
    assert message.startswith("TrainingDivergedError"), message
    assert "optimizer step overflowed" in message and "lr (now 1e+38)" in message, message
    assert not (out / "checkpoints").exists() or _checkpoints(out) == []


def run_with_zero_gradients(config, out, from_step):
    """Every rank's gradients are zero from optimizer step ``from_step`` on (what a model
    that diverged into saturation produces): the clip sees, and reports, a zero norm."""
    original = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def patched(params, max_norm, *args, **kwargs):
        params = list(params)
        calls["n"] += 1
        if calls["n"] >= from_step:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
        return original(params, max_norm, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = patched
    try:
        return _error_of(_train_logged, config, out)
    finally:
        torch.nn.utils.clip_grad_norm_ = original


def test_a_zero_gradient_norm_with_labels_stops_the_run(distributed, tmp_path):
    """Every rank's gradients zeroed from step 3, on 2 ranks: the same error on both."""
    config = two_rank_config(checkpoint_interval=1)
    out = tmp_path / "run"
    message = _same_everywhere(
        distributed.run(run_with_zero_gradients, config, str(out), 3, world_size=2, timeout=TIMEOUT)
    )
    assert message.startswith("TrainingDivergedError"), message
    assert "gradient norm is exactly 0 with" in message and "label tokens" in message, message
    assert [r["step"] for r in _rows(out)] == [1, 2], "step 3 is neither applied nor logged"
    assert _checkpoints(out)[-1] == "step_000002"


# ------------------------------------------------------------------ 5. a signal
def run_signalled(config, out, at_step, rank_signalled):
    """Rank ``rank_signalled`` gets SIGTERM during step ``at_step`` (from itself)."""
    from usp.train import data

    original = data.DataLoader.next_step
    calls = {"n": 0}

    def next_step(self):
        calls["n"] += 1
        if calls["n"] == at_step and torch.distributed.get_rank() == rank_signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    data.DataLoader.next_step = next_step
    try:
        job = train_config_from_dict(config)
        plan = Plan(topology(2, 2), layout=job.topology.attention.layout, verify_calls=False)
        result = train(job, plan, output_dir=out, stream=io.StringIO())
    finally:
        data.DataLoader.next_step = original
    return result.stopped_by, result.stopped_at, str(result.checkpoint)


def test_sigterm_saves_the_current_step_and_resume_continues(distributed, tmp_path, sp_faults_run):
    config, _, uninterrupted = sp_faults_run
    out = tmp_path / "run"
    results = distributed.run(run_signalled, config, str(out), 3, 2, world_size=4, timeout=TIMEOUT)
    assert results[2][0] == "SIGTERM"
    assert {r[0] for i, r in enumerate(results) if i != 2} == {"a signal on another rank"}
    assert {r[1] for r in results} == {3}, "every rank stopped after step 3"
    assert {r[2] for r in results} == {str(out / "checkpoints" / "step_000003")}
    assert (out / "checkpoints" / "step_000003" / "usp_meta.json").is_file()
    resumed = distributed.run(_train_logged, config, str(out), True, world_size=4, timeout=TIMEOUT)
    assert resumed[0][0] == uninterrupted[3:], "the resumed step 4 equals the uninterrupted one"


# ------------------------------------------------------------------ 6. damaged checkpoints
def _damage_newest(out, how: str):
    newest = out / "checkpoints" / "step_000004"
    if how == "metadata":
        (newest / ".metadata").unlink()
    elif how == "truncated shard":
        shard = sorted(newest.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "meta file":
        (newest / "usp_meta.json").write_text("{")


@pytest.mark.parametrize("how", ["metadata", "truncated shard", "meta file"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(
    distributed, tmp_path, sp_faults_run, how
):
    config, out, uninterrupted = sp_faults_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    _damage_newest(copy, how)
    results = distributed.run(
        _train_logged, config, str(copy), True, False, world_size=4, timeout=TIMEOUT
    )
    rows, log = results[0]
    assert rows == uninterrupted[2:], "resumed from step 2 exactly"
    if how != "meta file":  # an unreadable meta file is skipped before loading
        assert log.count("cannot be loaded") == 1, log
        assert "resuming from step_000002 instead" in log, log
    assert all(r[1] == "" for r in results[1:]), "only rank 0 prints"


def test_no_loadable_checkpoint_is_one_error(distributed, tmp_path, sp_faults_run):
    config, out, _ = sp_faults_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    for step in ("step_000002", "step_000004"):
        (copy / "checkpoints" / step / ".metadata").unlink()
    message = _same_everywhere(
        distributed.run(run_train_error, config, str(copy), True, world_size=4, timeout=TIMEOUT)
    )
    assert "CheckpointError" in message and "none of the complete checkpoints loads" in message
    assert "step_000004, step_000002" in message, message


def run_node_local(config, out):
    """Ranks 2 and 3 ("node 1") see no checkpoints, as with node-local storage."""
    from usp.train.checkpoint import Checkpointer

    original = Checkpointer.complete
    if torch.distributed.get_rank() >= 2:
        Checkpointer.complete = lambda self: []
    try:
        return run_train_error(config, out, True)
    finally:
        Checkpointer.complete = original


def test_ranks_that_see_other_checkpoints_fail_alike(distributed, tmp_path, sp_faults_run):
    config, out, _ = sp_faults_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    message = _same_everywhere(
        distributed.run(run_node_local, config, str(copy), world_size=4, timeout=60)
    )
    assert "CheckpointError" in message and "storage that all nodes share" in message, message
    assert "ranks 0, 1: step_000004" in message and "ranks 2, 3: none" in message, message


# ------------------------------------------------------------------ 7. a changed run
def test_resume_refuses_a_changed_run_and_reports_allowed_changes(
    distributed, tmp_path, sp_faults_run
):
    config, out, _ = sp_faults_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    changed = base_config(seed=4, seq_len=128, steps=5)
    changed["data"]["synthetic_length"] = 20
    message = _same_everywhere(
        distributed.run(run_train_error, changed, str(copy), True, world_size=4, timeout=60)
    )
    assert "CheckpointError" in message and "--resume-changed" in message, message
    for part in ("seed 3 -> 4", "seq_len 64 -> 128", "[data] synthetic_length: 24 -> 20"):
        assert part in message, message
    assert "lr" not in message.split("what a step sees:")[1].split(". Restore")[0]

    allowed = base_config(steps=5, lr=1e-3, log_interval=2)
    results = distributed.run(
        _train_logged, allowed, str(copy), True, world_size=4, timeout=TIMEOUT
    )
    log = results[0][1]
    assert [r[0] for r in results[0][0]] == [5]
    assert "changed since the checkpoint: " in log, log
    for part in ("log_interval 1 -> 2", "lr 0.003 -> 0.001", "steps 4 -> 5"):
        assert part in log, log


def test_resume_changed_accepts_it_knowingly(distributed, tmp_path, sp_faults_run):
    config, out, _ = sp_faults_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    changed = base_config(seed=5, steps=5)
    results = distributed.run(
        _train_logged, changed, str(copy), True, True, world_size=4, timeout=TIMEOUT
    )
    assert [r[0] for r in results[0][0]] == [5]
    assert "accepted with --resume-changed: seed 3 -> 5" in results[0][1], results[0][1]


# ------------------------------------------------------------------ 4. timeouts on every group
def run_topology_timeouts(timeout):
    from datetime import timedelta

    from usp.process_groups.topology import build_topology

    cpu = torch.device("cpu")
    topo = build_topology(2, 2, ranks_per_node=4, emulate_nodes=True, timeout=timeout)
    try:
        waits = {
            name: group._get_backend(cpu).options._timeout.total_seconds()
            for name, group in topo._groups.items()
        }
        default = torch.distributed.group.WORLD._get_backend(cpu).options._timeout
        bad = _error_of(build_topology, 2, 2, ranks_per_node=4, emulate_nodes=True, timeout=0)
    finally:
        topo.destroy()
        torch.distributed.group.WORLD.set_timeout(timedelta(seconds=600))  # the harness's
    return waits, default.total_seconds(), bad


def test_build_topology_sets_the_timeout_on_every_group(distributed):
    from datetime import timedelta

    results = distributed.run(run_topology_timeouts, 7.5, world_size=4, timeout=120)
    for waits, _, bad in results:
        assert set(waits) == {"ulysses", "ring", "dp", "sp", "dp_sp"}
        assert set(waits.values()) == {7.5}, waits
        assert bad == "TopologyError: timeout must be positive, got 0", bad
    results = distributed.run(
        run_topology_timeouts, timedelta(minutes=2), world_size=4, timeout=120
    )
    assert all(set(r[0].values()) == {120.0} for r in results), results
    inherited = distributed.run(run_topology_timeouts, None, world_size=4, timeout=120)
    for waits, default, _ in inherited:
        assert set(waits.values()) == {default}, "None: the default group's timeout"

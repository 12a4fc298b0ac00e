"""``usp train`` under signals and stalls, as users launch it (real torchrun processes).

- SIGTERM to the torchrun agent (what scancel and SLURM's --signal do): the workers
  finish the step in flight, save it, rank 0 prints one line, the workers exit 5; a
  second job on the same output directory, started meanwhile (``usp train`` in this
  process: another process than the job's), exits 2 naming the holder; a resume on one
  worker continues (DCP reshards the 2 ranks' checkpoint onto 1; resumes on several
  ranks: tests/train/test_train_faults.py, test_train_resume_families.py,
  test_train_integrity.py), and Ctrl-C, SIGINT to the whole process group, stops it the
  same way.
- A stalled rank (SIGSTOP): the others fail within ``collective_timeout_s`` naming the
  step, and the job ends.
- A second signal exits at once (a subprocess with the handlers only).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_cases import ROOT, free_port, torchrun, usp_in_process

LAUNCH_TIMEOUT_S = 240

CONFIG = """
[cluster]
nodes = 1
gpus_per_node = 2

[parallel]
ulysses = 2                # 2 ranks: signals and stalls do not depend on the grid
ring = 1

[model]
preset = "tiny"

[data]
source = "synthetic"
synthetic_documents = 64
synthetic_length = 24
document_multiple = 8

[train]
steps = 100000             # far more than the tests let run (400 were not, on a loaded machine)
global_batch = 2
seq_len = 64
lr = 1e-3
checkpoint_interval = 0
export = false
log_interval = 1
collective_timeout_s = 10
"""


def _command(config: Path, out: Path, *flags: str, workers: int = 2) -> list[str]:
    port = free_port()
    return torchrun(
        "--nproc-per-node", str(workers), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--shutdown-timeout", "60",
        "-m", "usp", "train", str(config), "--output", str(out), "--device", "cpu", *flags,
    )  # fmt: skip


def _start(command: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for_steps(out: Path, steps: int, agent: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        if agent.poll() is not None:
            pytest.fail(f"the job ended early:\n{log.read_text()}")
        time.sleep(0.2)
    os.killpg(agent.pid, signal.SIGKILL)
    pytest.fail(f"no {steps} steps within {LAUNCH_TIMEOUT_S} s:\n{log.read_text()}")


def _wait_for_lock(out: Path, agent: subprocess.Popen, log: Path) -> None:
    """Until rank 0 holds ``out``'s lock (the file names the holder)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    path = out / ".usp.lock"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return
        if agent.poll() is not None:
            pytest.fail(f"the job ended early:\n{log.read_text()}")
        time.sleep(0.2)
    os.killpg(agent.pid, signal.SIGKILL)
    pytest.fail(f"no lock within {LAUNCH_TIMEOUT_S} s:\n{log.read_text()}")


def _finish(agent: subprocess.Popen, log: Path, timeout: float = LAUNCH_TIMEOUT_S) -> str:
    try:
        agent.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        pytest.fail(f"the job did not end within {timeout} s:\n{log.read_text()}")
    return log.read_text()


def _workers_of(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the agent's worker processes (children with RANK set)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_saves_the_step_a_second_job_is_refused_and_resume_continues(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    log = tmp_path / "first.log"
    first = _start(_command(config, out), log)
    _wait_for_lock(out, first, log)

    # a second job on the same output directory (also with --resume) is refused: here
    # usp train in this process (a world of 1; another process than the job's, so the
    # lock is another process's), which needs no start-up of its own
    single = tmp_path / "single.toml"
    single.write_text(CONFIG.replace("gpus_per_node = 2", 'gpus_per_node = "auto"'))
    capsys.readouterr()
    status = usp_in_process(
        "train", str(single), "--output", str(out), "--resume", "--ulysses", "1", "--ring", "1",
        "--device", "cpu",
    )  # fmt: skip
    stderr = capsys.readouterr().err
    assert status == 2, stderr
    assert "is in use by another usp train job" in stderr, stderr
    assert f"pid {_workers_of(first.pid)[0]}" in stderr, stderr

    _wait_for_steps(out, 2, first, log)
    with open(out / ".usp.lock") as held, pytest.raises(BlockingIOError):
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still held while it trains
    first.send_signal(signal.SIGTERM)  # to the agent, as scancel/SLURM do
    text = _finish(first, log)
    rows = _metrics(out)
    step = rows[-1]["step"]
    line = f"stopped by SIGTERM at step {step}; checkpoint step_{step:06d}; --resume continues"
    assert line in text, text
    assert (out / "checkpoints" / f"step_{step:06d}" / "usp_meta.json").is_file()
    assert [r["step"] for r in rows] == list(range(1, step + 1)), "nothing lost"
    assert f'File "{ROOT / "usp"}' not in text, "no usp traceback (torchrun prints its own)"
    assert first.returncode == 1, (first.returncode, "torchrun re-raises the signal")

    # the resume continues from there, on one worker (DCP reshards the 2 ranks' shards);
    # Ctrl-C (SIGINT to every process: the agent and its worker) stops it alike
    log2 = tmp_path / "resume.log"
    flags = ("--resume", "--ulysses", "1", "--ring", "1")
    resumed = _start(_command(single, out, *flags, workers=1), log2)
    _wait_for_steps(out, step + 2, resumed, log2)
    os.killpg(resumed.pid, signal.SIGINT)
    text = _finish(resumed, log2)
    assert f"resuming from {out / 'checkpoints' / f'step_{step:06d}'}" in text, text
    rows = _metrics(out)
    again = rows[-1]["step"]
    assert f"stopped by SIGINT at step {again}; checkpoint step_{again:06d}" in text, text
    assert [r["step"] for r in rows] == list(range(1, again + 1))
    assert f'File "{ROOT / "usp"}' not in text, text


def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    log = tmp_path / "stall.log"
    agent = _start(_command(config, out), log)
    _wait_for_steps(out, 2, agent, log)
    workers = _workers_of(agent.pid)
    os.kill(workers[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    noticed = rank0_exited = None
    try:
        while agent.poll() is None and time.monotonic() - stopped_at < 120:
            if noticed is None and "a collective did not complete" in log.read_text():
                noticed = time.monotonic() - stopped_at
            if rank0_exited is None and _exited(workers[0]):
                rank0_exited = time.monotonic() - stopped_at
                # what torchrun does once rank 0 failed: SIGTERM to the stopped rank (held
                # while it is stopped), then SIGKILL 30 s later on torch 2.13 (its failure
                # path ignores --shutdown-timeout); the test does the SIGKILL at once
                os.kill(workers[1], signal.SIGKILL)
            time.sleep(0.2)
        text = _finish(agent, log, timeout=10)
    finally:
        if not _exited(workers[1]):  # a failed run: the stopped worker has its own session
            os.kill(workers[1], signal.SIGKILL)
    ended = time.monotonic() - stopped_at
    print(
        f"SIGSTOP of rank 1: error printed after {noticed} s, rank 0 exited after "
        f"{rank0_exited} s, the job ended after {ended:.1f} s"
    )
    # the 10 s collective timeout. Generous bounds: a loaded test machine is slow to
    # start and exit ranks.
    assert noticed is not None and noticed < 40, (noticed, text)
    assert rank0_exited is not None and rank0_exited < 60, (rank0_exited, text)
    assert ended < 120, (ended, text)
    assert "exitcode  : 4" in text, "the ranks that noticed exit 4"
    assert "a collective did not complete" in text, text
    assert "collective_timeout_s = 10" in text, text
    assert "step " in text.split("a collective did not complete")[0].splitlines()[-1], text
    assert agent.returncode != 0


SECOND_SIGNAL = """
import os, signal, sys, time
from usp.train.guard import StopSignal
with StopSignal() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # within 2 s: the same event
    print("first:", stop.name, flush=True)
    time.sleep(2.5)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
print("not reached", flush=True)
"""


def test_a_second_signal_exits_at_once():
    result = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout == "first: SIGTERM\n", result
    assert "second signal (SIGINT): exiting now without a checkpoint" in result.stderr, result
    assert result.returncode == 128 + signal.SIGINT

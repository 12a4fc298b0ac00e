"""``usp plan``'s command line on bad input and signals: every numeric flag past what the
plan represents is one message and exit 2, before torch loads and in under 2 s; the
same values from the file are refused too; SIGTERM and SIGINT stop the worker processes
(none is left). (``--json``'s ``max_seq_len_layout``: tests/planner/test_planner.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from planner_cases import write_config

from usp.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAST = [
    ("--seq-len", "1000000000000", "past 2,147,483,647"),
    ("--nodes", "1000000", "past 65,536"),
    ("--gpus-per-node", "70000", "past 65,536"),
    ("--gpu-memory-gib", "1e12", "past 1,048,576"),
    ("--host-memory-gib", "1e300", "past 1,048,576"),
    ("--jobs", "100000", "one worker per CPU"),
    ("--gpu-memory-gib", "nan", "expected a number > 0"),
    ("--seq-len", "1e12", "expected an integer >= 1"),
]


def _usp(*argv, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "usp", *argv], capture_output=True, text=True, env=env,
        timeout=120, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("flag, value, message", PAST)
def test_a_value_past_what_the_plan_represents_is_one_message(tmp_path, flag, value, message):
    path = write_config(tmp_path, gpus=2)
    started = time.perf_counter()
    result = _usp("plan", str(path), flag, value)
    seconds = time.perf_counter() - started
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) > 0 and seconds < 2.0, seconds


@pytest.mark.parametrize("train", ["seq_len = 4000000000", "micro_batch = 4\nseq_len = 1000000000"])
def test_the_files_values_are_bounded_too(tmp_path, capsys, train):
    """The same bound on the packed row (micro_batch x seq_len) from the config file."""
    path = write_config(tmp_path, gpus=2, global_batch=4)
    path.write_text(path.read_text().replace("seq_len = 512", train))
    code = main(["plan", str(path), "--jobs", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "tokens per packed row; the plan takes at most 2,147,483,647" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- signals
def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_plan_and_its_workers(tmp_path, signum):
    """The plan runs with 2 worker processes; the signal goes to the command's process
    alone (as a scheduler's SIGTERM does): it exits with 128 + N and one line, and no
    process it started is left."""
    path = write_config(tmp_path, gpus=8, layers=6, seq_len=4096)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "usp", "plan", str(path), "--jobs", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline, workers = time.monotonic() + 240, set()
        while time.monotonic() < deadline and proc.poll() is None:
            workers = _descendants(proc.pid)
            if len(workers) >= 2:  # the spawned workers (and multiprocessing's tracker)
                break
            time.sleep(0.2)
        assert proc.poll() is None and len(workers) >= 2, "the plan started its workers"
        time.sleep(1.0)
        workers |= _descendants(proc.pid)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err
    assert f"usp plan: stopped by {signal.Signals(signum).name}" in err
    assert "Traceback" not in err
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not [p for p in workers if _alive(p)], "a process of the plan is still running"


def test_the_command_lines_auto_is_the_configs():
    from usp.cli.args import AUTO
    from usp.config.toml import AUTO as config_auto

    assert config_auto == AUTO

"""``usp train CONFIG --nproc-per-node N``: torchrun's launcher in process, whose last line
is the first failing rank's usp error, with that rank's exit status (usp.cli.launch)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from launch_cases import run_agents, usp_in_process

from usp.cli import build_parser, main
from usp.cli.launch import (
    LAUNCH_DESTS,
    _torchrun_args,
    died_after_finishing,
    first_failure,
    worker_argv,
)
from usp.train.error_file import ENV, FINISHED, read_error_data, write_error_file

JOB = """
[cluster]
nodes = 1
gpus_per_node = 2
[parallel]
ulysses = 1
ring = 2
[model]
preset = "tiny"
[data]
files = ["train.jsonl"]
[train]
steps = 2
global_batch = 2
seq_len = 32
"""


def test_the_first_failing_ranks_error_is_the_last_line(tmp_path):
    """Two worker processes; the failure comes from a --set, so the workers got it."""
    config = tmp_path / "job.toml"
    config.write_text(JOB)
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    command = [
        sys.executable, "-m", "usp", "train", str(config), "--nproc-per-node", "2",
        "--output", str(tmp_path / "out"), "--device", "cpu",
        "--set", "data.files=missing.jsonl",
    ]  # fmt: skip
    (result,) = run_agents([command], tmp_path, timeout_s=240)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout  # a data error: the rank's own status
    assert lines[-1].startswith("usp train [rank "), lines[-1]
    assert f"data file {tmp_path / 'missing.jsonl'} does not exist" in lines[-1], lines[-1]
    assert "Traceback" not in result.stdout and "ChildFailedError" not in result.stdout


def test_workers_get_every_flag_but_the_launchers():
    parser = build_parser()
    argv = [
        "train", "job.toml", "--steps", "3", "--output", "o", "--ulysses", "auto", "--ring",
        "2", "--dp", "1", "--resume", "--resume-changed", "--device", "cpu",
        "--set", "train.lr=1e-3", "--set", "data.files=[\"a b.jsonl\"]",
        "--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0",
        "--master-addr", "127.0.0.1", "--master-port", "29511", "--shutdown-timeout", "120",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    (train,) = [a for a in parser._subparsers._actions if a.dest == "command"]
    rebuilt = parser.parse_args(["train", *worker_argv(train.choices["train"], args)])
    for key, value in vars(args).items():
        if key in LAUNCH_DESTS:
            assert getattr(rebuilt, key) is None, key
        elif key != "run":
            assert getattr(rebuilt, key) == value, key
    assert {d for d in LAUNCH_DESTS if getattr(args, d) is not None} == set(LAUNCH_DESTS)
    launched = _torchrun_args(args, ["train"])
    assert launched[launched.index("--shutdown-timeout") + 1] == "120"
    default = _torchrun_args(parser.parse_args(["train", "job.toml", "--nproc-per-node", "2"]), [])
    assert default[default.index("--shutdown-timeout") + 1] == "300"  # one step plus a save


def test_under_torchrun_the_launcher_flag_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "job.toml", "--nproc-per-node", "2"]) == 2
    assert "leave it out" in capsys.readouterr().err


def _failure(rank, *, data=None, exitcode=2, timestamp=100):
    return SimpleNamespace(
        error_file_data=data or {}, exitcode=exitcode, timestamp=timestamp, pid=1000 + rank,
        signal_name=lambda: "SIGKILL" if exitcode == -9 else "<N/A>",
    )  # fmt: skip


def test_the_earliest_recorded_error_wins(tmp_path, monkeypatch):
    def recorded(message, status, at):
        path = tmp_path / f"{at}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setattr("usp.train.error_file.time.time", lambda: at)
        write_error_file(message, status)
        return json.loads(path.read_text())

    late = recorded("usp train [rank 0]: error: b", 2, 50.7)
    early = recorded("usp train [rank 1]: error: a", 4, 50.2)
    assert read_error_data(early).message == "usp train [rank 1]: error: a"
    failures = {0: _failure(0, data=late), 1: _failure(1, data=early, exitcode=4)}
    assert first_failure(failures) == ("usp train [rank 1]: error: a", 4)
    # no rank wrote one (killed): what torchrun saw, as 128 + the signal
    line, status = first_failure({0: _failure(0, exitcode=-9), 1: _failure(1, timestamp=200)})
    assert status == 137 and "rank 0 (pid 1000) was killed by signal 9 (SIGKILL)" in line
    line, status = first_failure({1: _failure(1, exitcode=1)})
    assert status == 1 and "rank 1 (pid 1001) exited with status 1" in line


def _process_failure(tmp_path, rank, exitcode, record=None):
    """torchrun's record of a failed rank, reading the error file the rank left."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error{rank}.json"
    if record is not None:
        os.environ[ENV] = str(path)
        try:
            write_error_file(*record)
        finally:
            del os.environ[ENV]
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_a_rank_that_dies_after_the_run_finished_is_no_failed_run(tmp_path, monkeypatch, capsys):
    """Every failed rank recorded that its run finished (usp train does, before its
    teardown): the launcher says so, names the rank that died at exit, and exits 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    finished = (
        "usp train [rank 2]: the run finished (steps 1-4; checkpoint step_000004)",
        FINISHED,
    )
    failures = {
        2: _process_failure(tmp_path, 2, -6, finished),
        3: _process_failure(tmp_path, 3, -15, (finished[0].replace("2", "3", 1), FINISHED)),
    }
    line = died_after_finishing(failures)
    assert line.startswith("usp train: the run finished on every rank"), line
    assert "rank 2 (pid 1002) was killed by signal 6 (SIGABRT)" in line, line
    assert "rank 3 (pid 1003) was killed by signal 15 (SIGTERM)" in line, line

    def torchrun_that_fails(_):
        raise ChildFailedError("usp", failures)

    monkeypatch.setattr("torch.distributed.run.run", torchrun_that_fails)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "job.toml", "--nproc-per-node", "4"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == line

    # a rank that had not finished (its own error, or nothing recorded): a failed run,
    # and a finished rank's record is never taken for the error
    error = ("usp train [rank 1]: error: a collective failed", 4)
    mixed = {**failures, 1: _process_failure(tmp_path, 1, 4, error)}
    assert died_after_finishing(mixed) is None
    assert first_failure(mixed) == error
    unrecorded = {**failures, 0: _process_failure(tmp_path, 0, -9)}
    assert died_after_finishing(unrecorded) is None
    line, status = first_failure(unrecorded)
    assert status == 137 and "rank 0 (pid 1000) was killed by signal 9" in line, line


def test_usp_train_records_that_its_run_finished(tmp_path, monkeypatch):
    """The record a rank leaves before its teardown (here: one process, in-process)."""
    config = tmp_path / "job.toml"
    config.write_text(JOB.replace("gpus_per_node = 2", 'gpus_per_node = "auto"'))
    (tmp_path / "train.jsonl").write_text('{"text": "hello there"}\n' * 8)
    monkeypatch.setenv(ENV, str(tmp_path / "error.json"))
    monkeypatch.delenv("RANK", raising=False)
    argv = ["train", str(config), "--output", str(tmp_path / "out"), "--device", "cpu",
            "--ulysses", "1", "--ring", "1", "--steps", "1"]  # fmt: skip
    assert usp_in_process(*argv) == 0
    record = read_error_data(json.loads((tmp_path / "error.json").read_text()))
    assert record.finished and record.status == FINISHED == 0
    assert (
        record.message == "usp train [rank 0]: the run finished (steps 1-1; checkpoint step_000001)"
    )


def test_eval_workers_get_every_flag_but_the_launchers():
    """``usp eval ... --nproc-per-node N``: flags of several values (``--data``) and the
    comma lists a flag's type turns into tuples (``--lengths``, ``--depths``) reach the
    workers as the user gave them."""
    parser = build_parser()
    argv = [
        "eval", "runs/x", "--config", "job.toml", "--data", "a.jsonl", "b c.jsonl",
        "--lengths", "256,1024", "--passkey", "--depths", "0,0.5,1", "--trials", "3",
        "--seed", "7", "--dtype", "float32", "--ulysses", "2", "--ring", "auto",
        "--nproc-per-node", "4", "--master-port", "29512",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    (command,) = [a for a in parser._subparsers._actions if a.dest == "command"]
    rebuilt = parser.parse_args(["eval", *worker_argv(command.choices["eval"], args)])
    for key, value in vars(args).items():
        if key in LAUNCH_DESTS:
            assert getattr(rebuilt, key) is None, key
        elif key != "run":
            assert getattr(rebuilt, key) == value, key
    assert rebuilt.data == ["a.jsonl", "b c.jsonl"] and rebuilt.lengths == (256, 1024)

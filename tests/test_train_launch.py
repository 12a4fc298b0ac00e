"""``usp train`` as users launch it: real torchrun processes.

Two launches only (each starts 4 processes that import torch, several seconds on a small
machine): two torchrun agents on localhost acting as two nodes of 2 ranks each, with the
degrees given as flags; then one agent with 4 ranks that resumes that run from its
checkpoint (``--resume``) and trains one more step. The exported HF checkpoint is loaded
by ``usp.models.Llama`` and, when installed, by transformers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 240

TRAIN_SECTIONS = """
[parallel]
ulysses = "auto"           # the command line gives the degrees
ring = "auto"

[model]
preset = "tiny"

[data]
source = "synthetic"
synthetic_documents = 32
synthetic_length = 24
document_multiple = 8

[train]
steps = 10                 # the command line says 2
global_batch = 2
seq_len = 64
lr = 1e-3
checkpoint_interval = 0
log_interval = 1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(launch: list[str], train_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        "-m",
        "usp",
        "train",
        *train_args,
    ]


def run_agents(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Start every command (one torchrun agent each), wait for all, kill on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a hung agent and its workers can be killed together
        )
        for cmd in commands
    ]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    results = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a launch did not finish within {LAUNCH_TIMEOUT_S} s")
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return results


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    config = tmp / "two_nodes.toml"
    config.write_text("[cluster]\nnodes = 2\ngpus_per_node = 2\n" + TRAIN_SECTIONS)
    out = tmp / "run"
    port = str(_free_port())
    flags = ["--steps", "2", "--output", str(out), "--ulysses", "2", "--ring", "2", "--dp", "1"]
    commands = [
        _torchrun(
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ],
            [str(config), *flags, "--device", "cpu"],
        )  # fmt: skip
        for node in (0, 1)
    ]
    return tmp, out, run_agents(commands)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_train_and_report_where_everything_is(two_node_run):
    _, out, results = two_node_run
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n{result.stdout}"
    log = results[0].stdout
    assert "ulysses 0/2" in log and "ring 0/2" in log, log
    for line in ("metrics:", "loss plot:", "checkpoint:", "HF export:"):
        assert line in log, log
    assert "done:" not in results[1].stdout, "only global rank 0 reports"
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2], "--steps overrides the file"
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert (out / "loss.png").stat().st_size > 0
    assert (out / "checkpoints" / "step_000002" / "usp_meta.json").is_file()


def test_the_export_loads_in_usp_and_transformers(two_node_run):
    from usp.models import Llama

    _, out, results = two_node_run
    assert results[0].returncode == 0, results[0].stdout
    exported = out / "hf"
    model = Llama.from_pretrained(exported)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = model(ids)
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_resume_on_one_node_continues_the_two_node_run(two_node_run):
    tmp, out, results = two_node_run
    assert results[0].returncode == 0, results[0].stdout
    config = tmp / "one_node.toml"
    config.write_text("[cluster]\nnodes = 1\ngpus_per_node = 4\n" + TRAIN_SECTIONS)
    before = _metrics(out)
    command = _torchrun(
        ["--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())],
        [str(config), "--steps", "3", "--output", str(out), "--ulysses", "2", "--ring", "2", "--resume"],
    )  # fmt: skip
    (result,) = run_agents([command])
    assert result.returncode == 0, result.stdout
    assert "resuming from" in result.stdout and "step_000002" in result.stdout, result.stdout
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[:2] == before, "the steps before the checkpoint are kept as logged"
    assert (out / "checkpoints" / "step_000003" / "usp_meta.json").is_file()

"""Real torchrun launches for tests: agents on localhost, one per "node".

Each agent's output (its ranks' too) goes to a file, so no pipe can fill up and stall an
agent while the test waits on another; a launch that does not finish in time is killed
with its workers (each agent runs in its own session) and fails the test with every
agent's output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def usp_in_process(*argv: str) -> int:
    """``usp ARGV`` in this process (a world of one, no torchrun): its exit status. Torch's
    intra-op thread count is restored after it (the command shares the machine's cores
    out among a node's ranks, here all of them to the one)."""
    import torch

    from usp.cli import main

    threads = torch.get_num_threads()
    try:
        return main(list(argv))
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    """``torchrun ARGS`` with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def node_flags(node: int, nodes: int, nproc: int, port: int | str) -> list[str]:
    """torchrun's flags for agent ``node`` of a static ``nodes``-node launch on localhost."""
    return [
        "--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
    ]  # fmt: skip


def run_agents(
    commands: list[list[str]], log_dir: Path, timeout_s: float
) -> list[subprocess.CompletedProcess]:
    """Start every command (one torchrun agent each) from the repository root, wait for
    all within ``timeout_s``; ``stdout`` of each result is the agent's whole output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [log_dir / f"agent{i}-{time.monotonic_ns()}.log" for i in range(len(commands))]
    agents = []
    for command, log in zip(commands, logs):
        with open(log, "w") as out:
            agents.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a hung agent and its workers die together
                )
            )
    deadline = time.monotonic() + timeout_s
    try:
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [agent for agent in agents if agent.poll() is None]
        for agent in hung:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    outputs = [log.read_text() for log in logs]
    if hung:
        pytest.fail(
            f"a launch did not finish within {timeout_s} s:\n"
            + "\n".join(f"--- agent {i} ---\n{text}" for i, text in enumerate(outputs))
        )
    return [
        subprocess.CompletedProcess(agent.args, agent.returncode, text)
        for agent, text in zip(agents, outputs)
    ]

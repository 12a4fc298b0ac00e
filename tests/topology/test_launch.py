"""Real multi-node launches: two torchrun agents on localhost act as two nodes.

    torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --master-addr 127.0.0.1 ...

Each launch starts processes that import torch (several seconds on a small machine), so
there are two: the demo once, node 0's ranks with the cluster taken from the launch and
node 1's with it written out (nodes observed, a clean exit; every other launch in the
suite checks its clean exit too), and one config that contradicts the launch (a clear
error on every rank, fast; one rank per node, as the refusal needs no more).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from launch_cases import ROOT, free_port, node_flags, run_agents, torchrun

DEMO = ROOT / "examples" / "usp_attention_demo.py"
CPU_DEMO = ROOT / "examples" / "configs" / "cpu_demo.toml"
LAUNCH_TIMEOUT_S = 150  # per launch; a hang at an exit barrier would take 300 s or more


def launch_two_nodes(
    tmp_path: Path, configs: list[Path], *, nproc: int = 2
) -> list[subprocess.CompletedProcess]:
    """Run ``examples/usp_attention_demo.py`` under two torchrun agents (``nproc`` ranks
    each), node ``n``'s ranks with ``--config configs[n]``."""
    port = free_port()
    commands = [
        torchrun(*node_flags(node, 2, nproc, port), str(DEMO), "--config", str(config),
                 "--seq-len", "256")
        for node, config in enumerate(configs)
    ]  # fmt: skip
    return run_agents(commands, tmp_path, LAUNCH_TIMEOUT_S)


def auto_config(tmp_path: Path) -> Path:
    """cpu_demo.toml with the cluster taken from the launch."""
    text = CPU_DEMO.read_text()
    text = re.sub(r"(?m)^nodes = 1 .*$", 'nodes = "auto"', text)
    text = re.sub(r"(?m)^gpus_per_node = 4 .*$", 'gpus_per_node = "auto"', text)
    assert 'nodes = "auto"' in text and 'gpus_per_node = "auto"' in text
    path = tmp_path / "auto.toml"
    path.write_text(text)
    return path


def explicit_config(tmp_path: Path) -> Path:
    """cpu_demo.toml saying what the launch is: 2 nodes x 2 ranks."""
    text = CPU_DEMO.read_text()
    text = re.sub(r"(?m)^nodes = 1 .*$", "nodes = 2", text)
    text = re.sub(r"(?m)^gpus_per_node = 4 .*$", "gpus_per_node = 2", text)
    path = tmp_path / "two_nodes.toml"
    path.write_text(text)
    return path


def test_two_node_demo_reports_the_real_nodes_and_exits_cleanly(tmp_path):
    """One launch for both forms of [cluster]: rank 0 (node 0) reads the cluster from the
    launch, node 1's ranks read it written out; each rank checks its own config against
    the launch, so both forms are accepted and both name the nodes torchrun chose."""
    agents = launch_two_nodes(tmp_path, [auto_config(tmp_path), explicit_config(tmp_path)])
    both = "\n".join(a.stdout for a in agents)
    for node, agent in enumerate(agents):
        assert agent.returncode == 0, f"agent {node}:\n{agent.stdout}"
    assert "terminate called" not in both and "SIGABRT" not in both
    for rank in range(4):
        # the demo prints topo.describe(): the node torchrun put the rank on
        line = f"rank {rank}/4 (node {rank // 2}, local {rank % 2}):"
        assert line in agents[rank // 2].stdout, both
    assert "2 nodes x 2 ranks" in agents[0].stdout
    assert "OK: USP attention matches single-process attention" in agents[0].stdout


def test_config_that_contradicts_the_launch_fails_fast_on_every_rank(tmp_path):
    start = time.monotonic()
    agents = launch_two_nodes(tmp_path, [CPU_DEMO, CPU_DEMO], nproc=1)
    elapsed = time.monotonic() - start
    message = (
        "[cluster] config says 1 node x 4 ranks; torchrun launched 2 nodes x 1 rank. Make "
        '[cluster] nodes and gpus_per_node match the launch, or set nodes = "auto" and '
        'gpus_per_node = "auto" to take the launch\'s shape'
    )
    for node, agent in enumerate(agents):
        assert agent.returncode != 0, agent.stdout
        assert f"rank {node}: error: {CPU_DEMO}: {message}" in agent.stdout, agent.stdout
        # the demo reports the error itself: no worker traceback, no abort
        assert re.search(r"\[rank\d\]:\s*Traceback", agent.stdout) is None, agent.stdout
        assert "terminate called" not in agent.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s: the error should come right after start-up"

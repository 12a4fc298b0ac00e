"""``usp train`` as users launch it: real torchrun processes.

Two launches only (each worker imports torch, several seconds on a small machine): two
torchrun agents on localhost acting as two nodes of 2 ranks each, with the degrees given
as flags; then one agent with 1 rank that resumes that run from its checkpoint
(``--resume``) and trains one more step: another node layout, and another world (DCP
reshards the 4 ranks' shards onto 1; a resume that needed the writer's layout or world
would fail either way, so 1 rank shows it at a quarter of the start-up of 4). Resumes on
several ranks: tests/train/test_train_faults.py (4 ranks, ulysses 2 x ring 2),
test_train_resume_families.py (2 ranks per family) and test_train_integrity.py's torchrun
resume (2 ranks). The exported HF checkpoint is loaded by ``usp.models.Llama`` and, when
installed, by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch_cases import free_port, node_flags, run_agents, torchrun

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


def _usp_train(launch: list[str], train_args: list[str]) -> list[str]:
    return torchrun(*launch, "-m", "usp", "train", *train_args)


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    config = tmp / "two_nodes.toml"
    config.write_text("[cluster]\nnodes = 2\ngpus_per_node = 2\n" + TRAIN_SECTIONS)
    out = tmp / "run"
    flags = ["--steps", "2", "--output", str(out), "--ulysses", "2", "--ring", "2", "--dp", "1"]
    port = free_port()
    commands = [
        _usp_train(node_flags(node, 2, 2, port), [str(config), *flags, "--device", "cpu"])
        for node in (0, 1)
    ]
    return tmp, out, run_agents(commands, tmp, LAUNCH_TIMEOUT_S)


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
    config.write_text("[cluster]\nnodes = 1\ngpus_per_node = 1\n" + TRAIN_SECTIONS)
    before = _metrics(out)
    port = free_port()
    command = _usp_train(
        ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)],
        [str(config), "--steps", "3", "--output", str(out), "--ulysses", "1", "--ring", "1", "--resume"],
    )  # fmt: skip
    (result,) = run_agents([command], tmp, LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stdout
    assert "resuming from" in result.stdout and "step_000002" in result.stdout, result.stdout
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[:2] == before, "the steps before the checkpoint are kept as logged"
    assert (out / "checkpoints" / "step_000003" / "usp_meta.json").is_file()

"""examples/trl_sft.py as users launch it: ``torchrun --nproc-per-node 2 ... --ring 2``
(real processes, the process group from torchrun's environment, ``launch_plan``'s
topology, the contiguous layout) against the same script as one process (``python examples/trl_sft.py``: usp
at ``Plan(None)``). Random sampling (the default): usp's sampler draws the same global
batches whatever the grid, so the two runs log the same losses step by step.
"""

from __future__ import annotations

import pytest
from launch_cases import ROOT, free_port, node_flags, run_agents, torchrun

pytest.importorskip(
    "transformers", minversion="5.24", reason="the integration needs transformers 5.24"
)
pytest.importorskip("trl", reason="examples/trl_sft.py needs TRL")
pytest.importorskip("datasets", reason="the examples read their data with datasets")

import trainer_cases as tc  # noqa: E402

TOL = 1e-4


def test_torchrun_gives_the_one_process_losses(tmp_path):
    ckpt = tc.write_checkpoint(tmp_path / "llama", "llama")
    data = tc.write_chats(tmp_path / "chats.jsonl", 12, seed=4)
    common = [
        "--model", str(ckpt), "--data", str(data), "--max-steps", "3", "--batch-size", "3",
        "--lr", "1e-2", "--loss-chunk-tokens", "7", "--seed", "3",
    ]  # fmt: skip
    alone = tmp_path / "alone"
    assert tc.run_example_alone("trl_sft", [*common, "--output-dir", str(alone)]) == 0
    launched = tmp_path / "torchrun"
    command = torchrun(
        *node_flags(0, 1, 2, free_port()), str(ROOT / "examples" / "trl_sft.py"),
        *common, "--output-dir", str(launched), "--ring", "2", "--layout", "contiguous",
    )  # fmt: skip
    (result,) = run_agents([command], tmp_path, timeout_s=900)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "3 steps; loss" in result.stdout
    got, expected = tc.steps_of(launched), tc.steps_of(alone)
    assert [row["step"] for row in got] == [1, 2, 3]  # logging_steps=1: every step
    for g, e in zip(got, expected, strict=True):
        assert abs(g["loss"] - e["loss"]) <= TOL * e["loss"], (g, e)
        assert abs(g["grad_norm"] - e["grad_norm"]) <= TOL * e["grad_norm"], (g, e)
    assert (launched / "model.safetensors").is_file()

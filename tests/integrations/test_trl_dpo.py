"""examples/trl_dpo.py (TRL's DPOTrainer on usp) on 4 gloo ranks against the stock
DPOTrainer in one process (``--no-usp``: sdpa), 2 steps (the second on the weights the
first updated), sequential sampling: every step's loss, grad norm, rewards/chosen,
rewards/rejected and token count agree (1e-4 relative). u2 x r2 with the reference model
live; dp2 x r2 (the per-replica batch halved) with the reference log-probs precomputed
under SP (``precompute_ref_log_probs``).

Tiny Qwen3 (vocabulary 64, character tokenizer), float32.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5.24", reason="the integration needs 5.24")
pytest.importorskip("trl", reason="examples/trl_dpo.py needs TRL")
pytest.importorskip("datasets", reason="the examples read their data with datasets")

import rl_cases  # noqa: E402
import trainer_cases as tc  # noqa: E402

STEPS = 2
REL = 1e-4
BATCH = 4  # pairs per step, over all replicas
CASES = [((2, 2), {}), ((1, 2), {"precompute_ref_log_probs": True})]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_dpo")
    tc.write_checkpoint(root / "qwen3", "qwen3")
    rl_cases.write_pairs(root / "pairs.jsonl", 16, seed=3)
    return root


def argv(root, out, batch):
    return [
        "--model", str(root / "qwen3"), "--data", str(root / "pairs.jsonl"),
        "--output-dir", str(out), "--max-steps", str(STEPS), "--batch-size", str(batch),
        "--beta", "0.2", "--sampling", "sequential", "--seed", "4", "--no-save-model",
    ]  # fmt: skip


@pytest.mark.parametrize("grid, overrides", CASES, ids=["u2r2-live", "dp2r2-precomputed"])
def test_four_ranks_give_the_stock_trainers_steps(distributed, workdir, grid, overrides):
    overrides = {"learning_rate": 1e-3, **overrides}
    expected = workdir / f"ref-{len(overrides)}"
    assert rl_cases.run_example_alone(
        "trl_dpo", [*argv(workdir, expected, BATCH), "--no-usp"], overrides=overrides,
        fake_generation=False,
    ) == 0  # fmt: skip
    dp = 4 // (grid[0] * grid[1])
    got = workdir / f"usp-u{grid[0]}r{grid[1]}"
    results = distributed.run(
        rl_cases.run_example_on_ranks, "trl_dpo", argv(workdir, got, BATCH // dp), *grid,
        overrides=overrides, fake_generation=False, world_size=4, timeout=900,
    )  # fmt: skip
    assert [status for status, _ in results] == [0, 0, 0, 0]
    got_steps, expected_steps = tc.steps_of(got), tc.steps_of(expected)
    assert len(got_steps) == len(expected_steps) == STEPS
    seen = {  # printed (pytest -s): what the documents quote
        key: max(
            abs(g[key] - e[key]) / max(abs(e[key]), 1e-12)
            for g, e in zip(got_steps, expected_steps)
        )  # fmt: skip
        for key in ("loss", "grad_norm", "rewards/chosen")
    }
    print(f"seen relative differences {got.name}: {seen}")
    for step, (g, e) in enumerate(zip(got_steps, expected_steps), start=1):
        assert g.keys() == e.keys(), (step, sorted(set(g) ^ set(e)))
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen",
                    "entropy", "logits/chosen", "mean_token_accuracy", "num_tokens"):  # fmt: skip
            assert abs(g[key] - e[key]) <= REL * abs(e[key]) + 1e-7, (step, key, g[key], e[key])
    assert len({round(s["loss"], 4) for s in expected_steps}) > 1  # training moved

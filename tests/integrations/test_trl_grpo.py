"""examples/trl_grpo.py (TRL's GRPOTrainer on usp) on 4 gloo ranks against the stock
GRPOTrainer in one process (``--no-usp``: sdpa, no usp code on the path), 2 steps (with
num_iterations = 2 the second step reuses the first step's completions with the old
policy's log-probs: importance ratios away from 1, a KL away from 0 with beta > 0).

Generation is made deterministic (tests/helpers/rl_cases.py: a row's completion depends
only on its prompt and its index among that prompt's rows in the ``generate`` call, so
the same prompt groups give the same completions whichever rank generates them), and
every step's loss, grad norm, reward, KL and entropy must agree (1e-4 relative; the
loss near 0 within 1e-6 absolute). The cases cover the grids (u2 x r2, u1 x r4, and
dp2 x r2 with the per-replica batch halved), the families (Qwen3; Qwen3-MoE with the
router's aux loss; Qwen3.5 with Gated DeltaNet layers), every loss type and both
importance-sampling levels, a reference model (beta > 0) and the old policy's
log-probs (num_iterations = 2). One launch with real generation checks that the run
works and that every SP rank trains on the same completions.

Tiny models (vocabulary 64, character tokenizer), float32.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5.24", reason="the integration needs 5.24")
pytest.importorskip("trl", reason="examples/trl_grpo.py needs TRL")
pytest.importorskip("datasets", reason="the examples read their data with datasets")

import rl_cases  # noqa: E402
import trainer_cases as tc  # noqa: E402

STEPS = 2
REL = 1e-4
ABS = 1e-6
BATCH = 8  # completions per step, over all replicas
#: (family, (ulysses, ring), flags, GRPOConfig overrides); dp = 4 / (u * r)
CASES = [
    # the reference model (beta) and the old policy's log-probs (num_iterations = 2)
    ("qwen3", (2, 2), ["--loss-type", "grpo", "--beta", "0.05",
                       "--importance-sampling-level", "sequence"], {"num_iterations": 2}),
    # two replicas, each half the batch; TRL's global token count (dapo)
    # (and a sampling temperature in TRL's and usp's heads)
    ("qwen3", (1, 2), ["--loss-type", "dapo", "--sampling", "shuffled"], {"temperature": 0.7}),
    # the router's aux loss (Qwen3-MoE's output_router_logits) on a ring of 4
    ("qwen3_moe", (1, 4), ["--loss-type", "dr_grpo", "--beta", "0.02"], {}),
    # Gated DeltaNet layers (left-padded prompts: transformers' layers mask the pads)
    # ... with usp's levers: recomputed layers (their collectives again in backward), head
    # chunks of 3 tokens
    ("qwen3_5", (2, 2), ["--loss-type", "bnpo", "--importance-sampling-level", "sequence",
                         "--activation-checkpointing", "on", "--loss-chunk-tokens", "3"],
     {"num_iterations": 2}),
]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_grpo")
    tc.write_checkpoint(root / "qwen3", "qwen3")
    tc.write_checkpoint(
        root / "qwen3_moe", "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.1
    )
    tc.write_checkpoint(root / "qwen3_5", "qwen3_5")
    rl_cases.write_prompts(root / "prompts.jsonl", 12, seed=1)
    rl_cases.write_reward(root / "reward.py")
    return root


def argv(root, family, flags, out, batch):
    return [
        "--model", str(root / family), "--data", str(root / "prompts.jsonl"),
        "--reward", f"{root / 'reward.py'}:score", "--output-dir", str(out),
        "--max-steps", str(STEPS), "--batch-size", str(batch), "--num-generations", "4",
        "--max-completion-length", "10", "--sampling", "sequential", "--seed", "3",
        "--no-save-model", *flags,
    ]  # fmt: skip


def check_same_steps(got, expected) -> None:
    got_steps, expected_steps = tc.steps_of(got), tc.steps_of(expected)
    assert len(got_steps) == len(expected_steps) == STEPS
    seen = {  # printed (pytest -s): what the documents quote
        key: max(
            abs(g[key] - e[key]) / max(abs(e[key]), 1e-12)
            for g, e in zip(got_steps, expected_steps)
            if key in e
        )  # fmt: skip
        for key in ("loss", "grad_norm", "reward", "kl", "entropy")
        if key in expected_steps[0]
    }
    print(f"seen relative differences {got.name}: {seen}")
    for step, (g, e) in enumerate(zip(got_steps, expected_steps), start=1):
        for key in ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "num_tokens",
                    "aux_loss", "clip_ratio/region_mean", "completions/mean_length"):  # fmt: skip
            if key not in e:
                continue
            close = abs(g[key] - e[key]) <= REL * abs(e[key]) + (ABS if key == "loss" else 0)
            assert close, (step, key, g[key], e[key])
        assert g.keys() == e.keys(), (step, sorted(set(g) ^ set(e)))
    assert len({round(s["grad_norm"], 4) for s in expected_steps}) > 1  # training moved


@pytest.mark.parametrize(
    "family, grid, flags, overrides", CASES, ids=[f"{c[0]}-u{c[1][0]}r{c[1][1]}" for c in CASES]
)
def test_four_ranks_give_the_stock_trainers_steps(distributed, workdir, family, grid, flags,
                                                   overrides):  # fmt: skip
    overrides = {"learning_rate": 1e-3, **overrides}
    expected = workdir / f"ref-{family}-{'-'.join(flags)}"
    status = rl_cases.run_example_alone(
        "trl_grpo", [*argv(workdir, family, flags, expected, BATCH), "--no-usp"],
        overrides=overrides,
    )  # fmt: skip
    assert status == 0
    dp = 4 // (grid[0] * grid[1])
    got = workdir / f"usp-{family}-u{grid[0]}r{grid[1]}"
    results = distributed.run(
        rl_cases.run_example_on_ranks, "trl_grpo", argv(workdir, family, flags, got, BATCH // dp),
        *grid, overrides=overrides, world_size=4, timeout=900,
    )  # fmt: skip
    assert [status for status, _ in results] == [0, 0, 0, 0]
    check_same_steps(got, expected)
    if family == "qwen3_moe":  # the router's load-balancing loss is in the loss
        assert all(s["aux_loss"] > 0 for s in tc.steps_of(got))


def test_real_generation_runs_and_every_sp_rank_trains_on_the_same_completions(
    distributed, workdir
):
    """dp2 x r2, transformers' own sampling on each rank's copy of the policy, two
    micro-batches per step (the generation batch shuffled by one permutation per
    replica, then split): the two SP ranks of a replica compute their losses on the same
    completions; the replicas on different ones."""
    out = workdir / "real-generation"
    flags = argv(workdir, "qwen3", ["--loss-type", "grpo"], out, BATCH // 2)
    results = distributed.run(
        rl_cases.run_example_on_ranks, "trl_grpo", flags, 1, 2, fake_generation=False,
        spy=True, overrides={"gradient_accumulation_steps": 2}, world_size=4, timeout=900,
    )  # fmt: skip
    assert [status for status, _ in results] == [0, 0, 0, 0]
    rows = [steps for _, steps in results]
    assert all(len(r) == 2 * STEPS for r in rows)  # micro-batches
    assert rows[0] == rows[1] and rows[2] == rows[3]  # SP ranks (0, 1) and (2, 3)
    assert rows[0] != rows[2]  # the two replicas generate for different prompts
    completions = [tuple(ids) for step in rows[0] for ids in step[0]]
    assert len(set(completions)) > 1  # sampled, not one completion repeated
    assert len(tc.steps_of(out)) == STEPS


def run_expecting_an_error(flags):
    """The example with a reward function that fails on one prompt; returns (error class,
    message) and an all-reduce of the ranks' numbers afterwards."""
    import torch
    import torch.distributed as dist

    try:
        rl_cases.run_example_on_ranks("trl_grpo", flags, 1, 2)
        outcome = None
    except Exception as err:  # noqa: BLE001 - the outcome is what the test compares
        outcome = (type(err).__name__, str(err))
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total)
    return outcome, int(total)


def test_a_reward_function_failing_on_one_rank_fails_every_rank(distributed, workdir):
    """The first prompt (target 6) is scored by one rank only (its group is generated
    there): its ValueError is every rank's error, and the group still works after it."""
    reward = workdir / "failing_reward.py"
    reward.write_text(
        "def score(prompts, completions, target, **kwargs):\n"
        "    if 6 in target:\n"
        "        raise ValueError('reward exploded on purpose')\n"
        "    return [0.0] * len(prompts)\n"
    )
    flags = argv(workdir, "qwen3", [], workdir / "failing", BATCH // 2)
    flags[flags.index("--reward") + 1] = f"{reward}:score"
    results = distributed.run(run_expecting_an_error, flags, world_size=4, timeout=600)
    outcomes = [outcome for outcome, _ in results]
    assert all(o is not None and o[0] == "RankDisagreementError" for o in outcomes), outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes  # one message on every rank
    assert "usp: the reward functions failed on rank 0 of 4" in outcomes[0][1]
    assert "reward exploded on purpose" in outcomes[0][1]
    assert all(total == 0 + 1 + 2 + 3 for _, total in results)

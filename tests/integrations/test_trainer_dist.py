"""The two examples (examples/trl_sft.py: TRL's SFTTrainer, chat data, padding-free;
examples/hf_trainer.py: transformers' Trainer on text or token rows) on 4 gloo ranks
against the stock trainers in one process (``--no-usp``: sdpa, eager for gpt-oss; no usp
code on the path).

Every case compares, step by step, the loss and the gradient norm HF logged in
``DIR/trainer_state.json`` (within 1e-4 relative); the SGD cases also the final saved
weights (within 1e-5 of the largest weight: float32 rounding; see SGD below). The grid x
family x gradient accumulation cases are a pairwise covering: every pair of (u2 x r2 or
dp2 x r2, Llama-3 or Qwen3, accumulation 1 or 2) appears for each example (TRL's Llama
dp2 x r2 case with every lever on: checkpointing with host offload, MLP tiles, head
chunks, loss chunks); gpt-oss, Gemma 3, Qwen3-MoE, Qwen3.5 (each example) and
Qwen3.5-MoE (sliding windows shorter than the sequences, sinks, experts and the router's
aux loss, TRL's and transformers'; Gated DeltaNet layers) run once each. A planted bug
(the SP ranks' gradients averaged instead of summed) must fail the same comparison.

Tiny models (2 layers, 8 heads / 2 KV heads, vocabulary 64), 2 steps (the second on
weights and optimizer state the first step updated, at the schedule's second learning
rate; the evaluation case evaluates after each step and at the end), float32 (one bf16
autocast run against sdpa under autocast).
"""

from __future__ import annotations

import pytest
from model_cases import relative_error

pytest.importorskip(
    "transformers", minversion="5.24", reason="the integration needs transformers 5.24"
)
pytest.importorskip("trl", reason="examples/trl_sft.py needs TRL")
pytest.importorskip("datasets", reason="the examples read their data with datasets")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

import trainer_cases as tc  # noqa: E402

LOSS_TOL = NORM_TOL = 1e-4
WEIGHT_TOL = 1e-5
#: bf16 autocast against sdpa under autocast: both round every matmul to bf16 (8 bits of
#: mantissa, 4e-3 relative), in other orders; measured: 2e-4 on the losses, 1e-3 on the
#: grad norms
BF16_TOL = 1e-2
STEPS = 2
#: plain SGD: the final weights are the gradients' sums, so they agree to float32
#: rounding; AdamW normalises each entry by its own gradient's size, which turns the
#: rounding of near-zero gradient entries into lr-sized differences (seen: 1e-4 of the
#: largest weight after 3 steps at lr 1e-2), so its runs are compared by their losses
#: and gradient norms of every step (which depend on the previous steps' weights)
SGD = ["--optim", "sgd", "--lr", "0.1"]
#: (example, family, (ulysses, ring), accumulation, extra flags) ; dp = 4 / (u * r)
CASES = [
    ("trl_sft", "llama", (2, 2), 1, ["--loss-chunk-tokens", "7"]),
    # with every lever (checkpointing with host offload, MLP tiles of 5 tokens, 2 head
    # chunks: dp2 x r2 holds 2 KV heads per ring, loss chunks of 3 rows)
    ("trl_sft", "llama", (1, 2), 2, ["--activation-checkpointing", "offload",
                                     "--mlp-tile-tokens", "5", "--attention-head-chunks", "2",
                                     "--loss-chunk-tokens", "3", *SGD]),
    ("trl_sft", "qwen3", (2, 2), 2, ["--loss-chunk-tokens", "0", *SGD]),
    ("trl_sft", "qwen3", (1, 2), 1, ["--loss-chunk-tokens", "5", "--padded"]),  # TRL pads
    ("hf_trainer", "llama", (2, 2), 1, ["--loss-chunk-tokens", "0"]),
    ("hf_trainer", "llama", (1, 2), 2, ["--padding-free", "--eval", *SGD]),  # + eval_loss
    ("hf_trainer", "qwen3", (2, 2), 2, ["--loss-chunk-tokens", "9", "--max-length", "20", *SGD]),
    ("hf_trainer", "qwen3", (1, 2), 1, ["--tokens"]),  # 32-token rows: sharded dense
    # Mistral (its sliding window of 4096 holds every sequence) with levers on
    ("hf_trainer", "mistral", (2, 2), 1, ["--activation-checkpointing", "on",
                                          "--mlp-tile-tokens", "7", *SGD]),
    # the families of 2026 (sliding windows shorter than the sequences, sinks, experts):
    # gpt-oss (windows of 6, sinks; TRL's aux term, divided by the accumulation steps)
    # padded: transformers' gpt-oss gives its masks no position_ids, so its own
    # padding-free run attends across documents (usp's would not: no reference)
    ("trl_sft", "gpt_oss", (2, 2), 2, ["--padded", "--loss-chunk-tokens", "5"]),
    # Gemma 3 (windows of 5 on layers 0 and 2), padding-free
    ("trl_sft", "gemma3", (1, 2), 1, ["--loss-chunk-tokens", "0", *SGD]),
    # Qwen3-MoE with the aux loss (its statistics over both replicas' micro-batch)
    ("hf_trainer", "qwen3_moe", (1, 2), 2, ["--padding-free", *SGD]),
    # Qwen3.5 (Gated DeltaNet layers 0 and 2, usp's in transformers' model: heads over
    # ulysses, conv inputs and states along the ring); padded: transformers' torch path
    # runs a padding-free row's conversations as one sequence (no reference)
    ("trl_sft", "qwen3_5", (2, 2), 1, ["--padded", "--loss-chunk-tokens", "5", *SGD]),
    # ... transformers' Trainer on a ring of 4 (its padded text rows: one document each)
    ("hf_trainer", "qwen3_5", (1, 4), 1, ["--loss-chunk-tokens", "0", *SGD]),
    # Qwen3.5-MoE: Gated DeltaNet, experts with a shared one, TRL's aux term over 2 replicas
    ("trl_sft", "qwen3_5_moe", (1, 2), 2, ["--padded", "--loss-chunk-tokens", "5", *SGD]),
]  # fmt: skip
BATCH = 4  # rows / chats per optimizer micro-step, over all replicas


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_dist")
    for family in ("llama", "qwen3", "mistral", "gpt_oss", "gemma3", "qwen3_5", "qwen3_5_moe"):
        tc.write_checkpoint(root / family, family)
    # the load-balancing loss on (transformers adds 0.1 x aux to each micro-batch's loss)
    tc.write_checkpoint(
        root / "qwen3_moe", "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.1
    )
    tc.write_chats(root / "chats.jsonl", 24)
    tc.write_texts(root / "texts.jsonl", 24)
    tc.write_token_rows(root / "tokens.jsonl", 24, 32)
    tc.write_texts(root / "held_out.jsonl", 8, seed=9)
    return root


def argv(root, example, family, accumulation, extra, out, batch):
    data = {"trl_sft": "chats.jsonl", "hf_trainer": "texts.jsonl"}[example]
    flags = [f for f in extra if f not in ("--tokens", "--eval")]
    if "--tokens" in extra:
        data = "tokens.jsonl"
    if "--eval" in extra:  # a held-out loss after steps 1 and 2
        flags += ["--eval-data", str(root / "held_out.jsonl"), "--eval-steps", "1"]
    return [
        "--model", str(root / family), "--data", str(root / data), "--output-dir", str(out),
        "--max-steps", str(STEPS), "--batch-size", str(batch),
        "--gradient-accumulation", str(accumulation), "--lr", "1e-2",
        "--sampling", "sequential", *flags,  # a later --lr replaces this one
    ]  # fmt: skip


_REFERENCES: dict = {}


def reference(root, example, family, accumulation, extra):
    """The stock trainer in this process (cached per case: several grids share one)."""
    key = (example, family, accumulation, tuple(extra))
    if key not in _REFERENCES:
        out = root / f"ref-{example}-{family}-{accumulation}-{len(_REFERENCES)}"
        flags = argv(root, example, family, accumulation, extra, out, BATCH)
        assert tc.run_example_alone(example, [*flags, "--no-usp"]) == 0
        _REFERENCES[key] = out
    return _REFERENCES[key]


def distributed_run(distributed, root, example, family, grid, accumulation, extra, name, **kw):
    ulysses, ring = grid
    dp = 4 // (ulysses * ring)
    out = root / name
    flags = argv(root, example, family, accumulation, extra, out, BATCH // dp)
    results = distributed.run(
        tc.run_example_on_ranks, example, flags, ulysses, ring, **kw, world_size=4, timeout=600
    )
    assert results == [0, 0, 0, 0]
    return out


def check_same_run(got, expected, *, weights: bool) -> None:
    """Step by step the same losses and grad norms, and (``weights``) the same final
    weights."""
    got_steps, expected_steps = tc.steps_of(got), tc.steps_of(expected)
    assert len(got_steps) == len(expected_steps) == STEPS
    for step, (g, e) in enumerate(zip(got_steps, expected_steps), start=1):
        assert abs(g["loss"] - e["loss"]) <= LOSS_TOL * abs(e["loss"]), (step, g, e)
        assert abs(g["grad_norm"] - e["grad_norm"]) <= NORM_TOL * e["grad_norm"], (step, g, e)
    assert len({round(s["loss"], 3) for s in expected_steps}) > 1  # training moved
    # each replica's tokens once: what one process saw (HF counts every process's)
    assert [s["num_input_tokens_seen"] for s in got_steps] == [
        s["num_input_tokens_seen"] for s in expected_steps
    ]
    got_evals, expected_evals = tc.eval_losses_of(got), tc.eval_losses_of(expected)
    assert len(got_evals) == len(expected_evals)
    for g, e in zip(got_evals, expected_evals):
        assert abs(g - e) <= LOSS_TOL * e, (got_evals, expected_evals)
    if not weights:
        return
    got_weights, expected_weights = tc.weights_of(got), tc.weights_of(expected)
    assert got_weights.keys() == expected_weights.keys()
    errors = {n: relative_error(got_weights[n], w) for n, w in expected_weights.items()}
    assert max(errors.values()) <= WEIGHT_TOL, errors


@pytest.mark.parametrize(
    "example, family, grid, accumulation, extra",
    CASES,
    ids=[f"{c[0]}-{c[1]}-u{c[2][0]}r{c[2][1]}-ga{c[3]}" for c in CASES],
)
def test_four_ranks_give_the_one_process_run(
    distributed, workdir, example, family, grid, accumulation, extra
):
    expected = reference(workdir, example, family, accumulation, extra)
    name = f"{example}-{family}-u{grid[0]}r{grid[1]}-ga{accumulation}"
    got = distributed_run(distributed, workdir, example, family, grid, accumulation, extra, name)
    check_same_run(got, expected, weights="sgd" in extra)
    if grid == (2, 2):  # HF's FLOP estimate, each SP rank's share (padding counts in it,
        # so with dp the replicas' padded rows differ from one process's)
        flos = [tc.state_of(d)["total_flos"] for d in (got, expected)]
        assert abs(flos[0] - flos[1]) <= 1e-6 * flos[1], flos
    if "--eval" in extra:  # after step 1, after step 2 and trainer.evaluate()
        assert len(tc.eval_losses_of(got)) == 3
    if example == "trl_sft":  # TRL's token count: every replica's tokens once
        assert tc.steps_of(got)[-1]["num_tokens"] == tc.steps_of(expected)[-1]["num_tokens"]


def test_an_averaged_sp_gradient_fails_the_comparison(distributed, workdir):
    """Planted: FSDP's reduction divides the SP ranks' gradients by sp (an average where
    a sum is exact). The same comparison must fail (the grad norm is 4x too small)."""
    extra = ["--loss-chunk-tokens", "7"]
    expected = reference(workdir, "trl_sft", "llama", 1, extra)
    got = distributed_run(
        distributed, workdir, "trl_sft", "llama", (2, 2), 1, extra, "planted-average",
        planted="average_sp_gradients",
    )  # fmt: skip
    with pytest.raises(AssertionError):
        check_same_run(got, expected, weights=False)
    ratio = tc.steps_of(expected)[0]["grad_norm"] / tc.steps_of(got)[0]["grad_norm"]
    assert abs(ratio - 4) < 1e-3, ratio


def test_bf16_autocast_matches_sdpa_under_autocast(distributed, workdir):
    """``bf16=True``: accelerate's autocast around the model; USP attention gets float32
    q/k (RoPE's float32 tables) and bf16 v, and computes them in bf16 as sdpa does."""
    extra = ["--bf16", "--loss-chunk-tokens", "7", "--no-save-model"]
    expected = reference(workdir, "trl_sft", "llama", 1, extra)
    got = distributed_run(distributed, workdir, "trl_sft", "llama", (2, 2), 1, extra, "bf16")
    got_steps, expected_steps = tc.steps_of(got), tc.steps_of(expected)
    assert len(got_steps) == len(expected_steps) == STEPS
    for g, e in zip(got_steps, expected_steps):
        assert abs(g["loss"] - e["loss"]) <= BF16_TOL * abs(e["loss"]), (g, e)
        assert abs(g["grad_norm"] - e["grad_norm"]) <= BF16_TOL * e["grad_norm"], (g, e)


def run_plans_from_the_flags(topology_file):
    """The examples' flags to a plan: the degrees and layout, or a topology file."""
    import argparse

    from usp.integrations import hf_cli

    parser = argparse.ArgumentParser()
    hf_cli.add_arguments(parser)
    found = []
    for flags in (
        ["--ulysses", "2", "--ring", "2", "--layout", "contiguous"],
        ["--ring", "2"],  # dp = 2
        ["--topology", topology_file],
    ):
        plan = hf_cli.plan_from_args(parser.parse_args(flags))
        t = plan.topology
        found.append((t.ulysses_degree, t.ring_degree, t.dp_degree, plan.layout, plan.ring_impl,
                      plan.linear_backend))  # fmt: skip
        t.destroy()
    return found


def test_the_plan_comes_from_the_flags_or_a_topology_file(distributed, tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(
        "[cluster]\nnodes = 1\ngpus_per_node = 4\n[parallel]\nulysses = 1\nring = 4\n"
        '[attention]\nring_impl = "allgather"\nlinear_backend = "torch"\n'
        "[model]\nnum_heads = 8\nnum_kv_heads = 2\n"
    )
    for found in distributed.run(run_plans_from_the_flags, str(path), world_size=4, timeout=120):
        assert found == [
            (2, 2, 1, "contiguous", "p2p", "auto"),
            (1, 2, 2, "zigzag", "p2p", "auto"),
            (1, 4, 1, "zigzag", "allgather", "torch"),  # the file's GDN kernel choice too
        ]

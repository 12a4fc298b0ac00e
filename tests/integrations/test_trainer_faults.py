"""The Trainer integration's failure paths on 4 gloo ranks: each is the same error on
every rank (its class and message), and the process groups stay usable after it.

* SP ranks given different batches (planted: the ranks of data-parallel replica 0
  sample by global rank, as a loader sharding by process would; equal-length rows, so
  only the tokens differ): dense rows on u2 x r2 (the dense fingerprint agreement),
  padding-free rows on dp2 x r2 (the fingerprint in ``Plan.pack``'s agreement; replica 1
  was fed correctly and learns of replica 0's error through the replicas' agreement);
* a model feature USP attention cannot compute exactly: attention dropout (refused when
  the trainer is built; sliding windows and sinks are computed: test_trainer_dist.py);
* a hybrid model usp does not compute (MiniMax: lightning attention beside softmax
  attention) under SP,
  refused when ``UspTrainer`` / ``UspSFTTrainer`` is built, with the model type, the
  layers and the fix, on every rank (Qwen3.5's Gated DeltaNet layers and Bamba's Mamba-2
  layers are computed by usp's modules: test_trainer_dist.py's qwen3_5 case,
  test_hf_mamba2_swap.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "transformers", minversion="5.24", reason="the integration needs transformers 5.24"
)
pytest.importorskip("datasets", reason="the examples read their data with datasets")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

import trainer_cases as tc  # noqa: E402
from hybrid_cases import HYBRID, build  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_faults")
    tc.write_checkpoint(root / "llama", "llama")
    tc.write_checkpoint(root / "dropout", "llama", attention_dropout=0.1)
    hybrid = build("minimax", HYBRID["minimax"], seed=5)
    hybrid.save_pretrained(root / "minimax")
    tc.write_tokenizer(root / "minimax")
    tc.write_token_rows(root / "tokens.jsonl", 16, 32)
    tc.write_texts(root / "texts.jsonl", 16)
    return root


def run_expecting_an_error(name, argv, ulysses, ring, planted=None):
    """The example on every rank; returns (error class, message) or None, then checks
    that the world group still works (an all-reduce of the ranks' numbers)."""
    import torch
    import torch.distributed as dist

    try:
        tc.run_example_on_ranks(name, argv, ulysses, ring, planted=planted)
        outcome = None
    except Exception as err:  # noqa: BLE001 - the outcome is what the test compares
        outcome = (type(err).__name__, str(err))
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total)
    return outcome, int(total)


def flags(root, model, data, out, *extra):
    return [
        "--model", str(root / model), "--data", str(root / data), "--output-dir", str(out),
        "--max-steps", "2", "--batch-size", "2", "--sampling", "sequential", *extra,
    ]  # fmt: skip


def same_error_everywhere(results, kind: str, *needles: str) -> str:
    outcomes = [outcome for outcome, _ in results]
    assert all(o is not None and o[0] == kind for o in outcomes), outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes  # one message on every rank
    assert all(total == 0 + 1 + 2 + 3 for _, total in results)  # the group still works
    for needle in needles:
        assert needle in outcomes[0][1], outcomes[0][1]
    return outcomes[0][1]


@pytest.mark.parametrize(
    "grid, extra", [((2, 2), []), ((1, 2), ["--padding-free"])], ids=["dense-u2r2", "packed-dp2r2"]
)
def test_sp_ranks_holding_different_batches_fail_every_rank(distributed, workdir, grid, extra):
    argv = flags(workdir, "llama", "tokens.jsonl", workdir / f"mixed-{grid}", *extra)
    results = distributed.run(
        run_expecting_an_error, "hf_trainer", argv, *grid,
        planted="replica0_samples_by_rank", world_size=4, timeout=600,
    )  # fmt: skip
    message = same_error_everywhere(
        results, "RankDisagreementError", "the global batch they shard", "by data-parallel rank"
    )
    if grid == (1, 2):  # replica 1 was right: it hears of replica 0 through the replicas
        assert message.startswith("usp: the step's batches failed on") or message.startswith(
            "usp: this micro-batch failed on"
        ), message


def test_attention_dropout_is_refused_on_every_rank(distributed, workdir):
    argv = flags(workdir, "dropout", "texts.jsonl", workdir / "dropout-run")
    results = distributed.run(
        run_expecting_an_error, "hf_trainer", argv, 2, 2, world_size=4, timeout=600
    )
    same_error_everywhere(
        results, "UnsupportedModelError", "attention dropout", "attention_dropout=0.1"
    )


@pytest.mark.parametrize("example", ["hf_trainer", "trl_sft"])
def test_a_hybrid_model_is_refused_when_the_trainer_is_built(distributed, workdir, example):
    """MiniMax's lightning attention layers would see only each rank's shard: refused at construction
    (an UnsupportedModelError naming the model type, the layers and the fix, not an
    AttributeError), the same on every rank, the groups usable afterwards."""
    data = "texts.jsonl" if example == "hf_trainer" else "chats.jsonl"
    if example == "trl_sft":
        tc.write_chats(workdir / data, 8)
    argv = flags(workdir, "minimax", data, workdir / f"hybrid-{example}")
    results = distributed.run(
        run_expecting_an_error, example, argv, 1, 2, world_size=4, timeout=600
    )
    same_error_everywhere(
        results, "UnsupportedModelError", "model_type 'minimax'",
        "layers 0: self_attn (MiniMaxLightningAttention", "ulysses 1 x ring 2", "ulysses = ring = 1",
    )  # fmt: skip

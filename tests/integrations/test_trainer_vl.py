"""TRL's vision-language SFT data through usp's Trainer integration (issue 55):
``examples/trl_sft.py`` on records with images (a tiny Gemma 3 vision-language model and
its processor: TRL's vision collator pads rows, the processor gives ``token_type_ids``,
so every image block is bidirectional) on 4 gloo ranks against its ``--no-usp`` run
(the stock SFTTrainer in one process, sdpa): step by step the same losses and gradient
norms (1e-4 relative) and, with SGD, the same final weights (within 1e-5 of the largest
weight), the vision tower's included. u2 x r2 with the
logits' loss; dp2 x r2 with gradient accumulation 2 and the chunked loss.

``UspTrainer`` (no TRL) on padded Gemma 3 rows with images and the model's own collated
inputs, u2 x r2 against transformers' ``Trainer`` in one process: every step's loss.

Also the batch conversion itself (one process): TRL's padded rows become documents, the
token types packed with their tokens, the pixels as they are.
"""

from __future__ import annotations

import pytest
import torch
import trainer_cases as tc
import vl_cases

pytest.importorskip("transformers", minversion="5.25")
pytest.importorskip("trl", reason="examples/trl_sft.py needs TRL")
pytest.importorskip("datasets", reason="the example reads its data with datasets")
pytest.importorskip("PIL", reason="the image records are PNG files")

import usp  # noqa: E402
from usp.integrations.hf_batches import global_batch  # noqa: E402

LOSS_TOL = NORM_TOL = 1e-4
WEIGHT_TOL = 1e-5
STEPS, BATCH = 2, 4  # 2 steps: the second on the weights the first updated
SGD = ["--optim", "sgd", "--lr", "0.5"]
CASES = {  # grid, gradient accumulation, flags
    "u2r2": ((2, 2), 1, ["--loss-chunk-tokens", "0", *SGD]),
    "dp2r2-ga2": ((1, 2), 2, ["--loss-chunk-tokens", "5"]),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_vl")
    vl_cases.write_gemma3_checkpoint(root / "gemma3")
    vl_cases.write_image_chats(root / "chats.jsonl", 24)
    return root


def _argv(root, out, accumulation, batch, extra):
    return [
        "--model", str(root / "gemma3"), "--data", str(root / "chats.jsonl"),
        "--output-dir", str(out), "--max-steps", str(STEPS), "--batch-size", str(batch),
        "--gradient-accumulation", str(accumulation), "--lr", "1e-2",
        "--sampling", "sequential", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_image_chats_on_four_ranks_give_the_stock_trainer_run(distributed, workdir, case):
    (ulysses, ring), accumulation, extra = CASES[case]
    expected = workdir / f"ref-{case}"
    flags = _argv(workdir, expected, accumulation, BATCH, extra)
    assert tc.run_example_alone("trl_sft", [*flags, "--no-usp"]) == 0
    got = workdir / case
    dp = 4 // (ulysses * ring)
    flags = _argv(workdir, got, accumulation, BATCH // dp, extra)
    results = distributed.run(
        tc.run_example_on_ranks, "trl_sft", flags, ulysses, ring, world_size=4, timeout=600
    )
    assert results == [0, 0, 0, 0]
    got_steps, expected_steps = tc.steps_of(got), tc.steps_of(expected)
    assert len(got_steps) == len(expected_steps) == STEPS
    for step, (g, e) in enumerate(zip(got_steps, expected_steps), start=1):
        assert abs(g["loss"] - e["loss"]) <= LOSS_TOL * abs(e["loss"]), (step, g, e)
        assert abs(g["grad_norm"] - e["grad_norm"]) <= NORM_TOL * e["grad_norm"], (step, g, e)
    assert len({round(s["loss"], 3) for s in expected_steps}) > 1  # training moved
    if "sgd" in extra:
        got_weights, expected_weights = tc.weights_of(got), tc.weights_of(expected)
        assert got_weights.keys() == expected_weights.keys()
        assert any("vision_tower" in n for n in got_weights)
        # against the largest weight (the key projections' biases have no gradient: their
        # values are float32 rounding around 0 in both runs)
        scale = max(w.abs().max().item() for w in expected_weights.values())
        errors = {
            n: (got_weights[n] - w).abs().max().item() / scale for n, w in expected_weights.items()
        }
        assert max(errors.values()) <= WEIGHT_TOL, errors


def test_padded_rows_with_images_become_documents():
    rows = [vl_cases.batch("gemma3", parts, seed=i) for i, parts in
            enumerate([[2, ("image",), 3], [1, ("image",), 1]])]  # fmt: skip
    width = max(r["input_ids"].shape[1] for r in rows)

    def padded(key, value):
        return torch.stack([torch.nn.functional.pad(r[key][0], (0, width - r[key].shape[1]),
                                                    value=value) for r in rows])  # fmt: skip

    mask = padded("input_ids", -1) != -1
    inputs = {
        "input_ids": padded("input_ids", 0), "attention_mask": mask.long(),
        "token_type_ids": padded("token_type_ids", 0),
        "pixel_values": torch.cat([r["pixel_values"] for r in rows]),
    }  # fmt: skip
    inputs["labels"] = inputs["input_ids"].masked_fill(~mask, -100)
    batch = global_batch(inputs, usp.Plan(None))
    assert batch.cu_seqlens.tolist() == [0, 11, 8 + 11]
    assert torch.equal(batch.input_ids[0], torch.cat([r["input_ids"][0] for r in rows]))
    assert torch.equal(
        batch.media["token_type_ids"][0], torch.cat([r["token_type_ids"][0] for r in rows])
    )
    assert batch.media["pixel_values"] is inputs["pixel_values"]


# ------------------------------------------------------------------ UspTrainer, no TRL
ROW_PARTS = [[2, ("image",), 3], [1, ("image",), 1, ("image",), 2], [4, ("image",), 1],
             [3, ("image",), 5]] * 2  # fmt: skip


def _image_rows() -> list[dict]:
    """Gemma 3 rows of processor outputs (token types, pixels), one record each."""
    rows = []
    for seed, parts in enumerate(ROW_PARTS):
        row = vl_cases.batch("gemma3", parts, seed=seed)
        rows.append({"input_ids": row["input_ids"][0], "token_type_ids": row["token_type_ids"][0],
                     "pixel_values": row["pixel_values"]})  # fmt: skip
    return rows


def _collate(records: list[dict]) -> dict:
    """Right-padded rows (pad id 0), labels masked at padding and image tokens."""
    width = max(len(r["input_ids"]) for r in records)

    def padded(key):
        return torch.stack([torch.nn.functional.pad(r[key], (0, width - len(r[key])))
                            for r in records])  # fmt: skip

    mask = torch.stack([torch.arange(width) < len(r["input_ids"]) for r in records])
    ids = padded("input_ids")
    return {
        "input_ids": ids, "attention_mask": mask.long(), "token_type_ids": padded("token_type_ids"),
        "pixel_values": torch.cat([r["pixel_values"] for r in records]),
        "labels": ids.masked_fill(~mask | (ids == vl_cases.IMAGE), -100),
    }  # fmt: skip


def _train(trainer_class, out, **extra) -> list[float]:
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=0.5, optim="sgd", logging_steps=1, report_to=[], disable_tqdm=True,
        train_sampling_strategy="sequential", remove_unused_columns=False, save_strategy="no",
        dataloader_pin_memory=False,
    )  # fmt: skip
    model = vl_cases.build("gemma3")
    trainer = trainer_class(model=model, args=args, train_dataset=_image_rows(),
                            data_collator=_collate, **extra)  # fmt: skip
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def run_usp_trainer(out):
    from usp_cases import topology

    from usp.integrations.transformers import UspTrainer

    plan = usp.Plan(topology(2, 2))
    with tc.accelerate_world():
        return _train(UspTrainer, out, plan=plan)


def test_usp_trainer_on_image_rows_gives_the_stock_trainer_run(distributed, tmp_path):
    """UspTrainer (no TRL) on padded Gemma 3 rows with images, u2 x r2: every step's loss
    within 1e-4 of transformers' Trainer in one process (sdpa)."""
    import transformers

    expected = _train(transformers.Trainer, tmp_path / "stock")
    results = distributed.run(run_usp_trainer, tmp_path / "usp", world_size=4, timeout=600)
    assert len(expected) == STEPS and len(set(expected)) > 1  # training moved
    for losses in results:
        assert len(losses) == STEPS
        for got, want in zip(losses, expected):
            assert abs(got - want) <= LOSS_TOL * abs(want), (losses, expected)
    worst = max(abs(g - w) / abs(w) for losses in results for g, w in zip(losses, expected))
    print(f"UspTrainer u2xr2 against the stock Trainer: losses {expected}, worst {worst:.3g}")

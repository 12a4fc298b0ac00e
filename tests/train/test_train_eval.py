"""``[eval]``: the held-out loss during training, under SP, against one process and a
hand-written loop.

The held-out file holds documents of 34-58 tokens: padded to multiples of 8 (40-64) each
fills one 64-token sequence alone, so "the first N sequences" are "the first N
documents" and the reference needs no packing. The reference loop loads each DCP
checkpoint the run saved into a plain one-process model and sums
``F.cross_entropy`` over every document's full logits (no packing, sharding or usp loss
code); the 4-rank trainer's evaluations must equal it and the one-process trainer's.
"""

from __future__ import annotations

import io
import json
import random
import string
import struct
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from train_cases import base_config
from usp_cases import topology

from usp.train.components import build_plan
from usp.train.config import ConfigError, train_config_from_dict
from usp.train.metrics import Progress, plot_loss
from usp.train.png_chart import SECOND, write_line_chart
from usp.train.trainer import train

TIMEOUT = 240
EVAL_KEYS = ("step", "eval_loss", "eval_tokens", "eval_sequences")


def held_out_texts(count: int = 6, seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choices(string.ascii_lowercase + " ", k=rng.randint(32, 56)))
        for _ in range(count)
    ]


def write_held_out(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def eval_config(held_out: str, *, every=2, max_batches=None, **train) -> dict:
    config = base_config(**train)
    config["eval"] = {"files": [held_out], "every": every}
    if max_batches is not None:
        config["eval"]["max_batches"] = max_batches
    return config


def _train_on_ranks(config, ulysses, ring, out, resume=False, stop_after=None):
    job = train_config_from_dict(config)
    plan = build_plan(job, topology(ulysses, ring))
    result = train(
        job, plan, output_dir=out, resume=resume, stop_after=stop_after, stream=io.StringIO()
    )
    return [(r["step"], r["loss"]) for r in result.metrics], result.evaluations


def _single(config, out):
    result = train(train_config_from_dict(config), None, output_dir=out, stream=io.StringIO())
    return result.evaluations


def reference_loss(checkpoint, config: dict, texts) -> tuple[float, int]:
    """The eval loss of the weights in a DCP checkpoint, by hand: one process, each
    document alone (BOS + bytes + EOS, every next token a label), full logits."""
    import torch.distributed.checkpoint as dcp

    from usp.models import Llama, preset

    with torch.device("meta"):
        model = Llama(preset(config["model"]["preset"]), None)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state["model"])
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([2, *text.encode(), 3])  # the byte tokenizer's BOS 2, EOS 3
            logits = model(ids[None])[0]  # [n, V]
            total += F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")
            count += ids.numel() - 1
    return float(total) / count, count


def _values(evaluations) -> list[dict]:
    """The rows without their timing (which differs between ranks)."""
    return [{k: v for k, v in e.items() if k != "eval_time_s"} for e in evaluations]


def _relative(a, b) -> float:
    return abs(a - b) / abs(b)


def _eval_rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in EVAL_KEYS} for r in rows if "eval_loss" in r]


@pytest.fixture(scope="module")
def sp_eval_run(distributed, tmp_path_factory):
    """Ulysses 2 x ring 2 with [eval] every 2 steps, max_batches 1 (4 of the 6 documents)."""
    tmp = tmp_path_factory.mktemp("eval_run")
    texts = held_out_texts()
    config = eval_config(write_held_out(tmp / "held.jsonl", texts), max_batches=1)
    out = tmp / "sp"
    results = distributed.run(
        _train_on_ranks, config, 2, 2, str(out), world_size=4, timeout=TIMEOUT
    )
    return config, texts, out, results


def test_eval_loss_on_4_ranks_equals_one_process_and_a_hand_written_loop(sp_eval_run, tmp_path):
    config, texts, out, results = sp_eval_run
    evaluations = results[0][1]
    assert all(_values(r[1]) == _values(evaluations) for r in results), "the same on every rank"
    assert [e["step"] for e in evaluations] == [2, 4], "every 2 steps and after the last"
    single = _single(config, tmp_path / "single")
    for ours, ref_row in zip(evaluations, single):
        assert (ours["eval_tokens"], ours["eval_sequences"]) == (
            ref_row["eval_tokens"],
            ref_row["eval_sequences"],
        )
        assert _relative(ours["eval_loss"], ref_row["eval_loss"]) < 1e-5, (ours, ref_row)
    for row in evaluations:  # the checkpoints of steps 2 and 4 hold the evaluated weights
        checkpoint = out / "checkpoints" / f"step_{row['step']:06d}"
        loss, count = reference_loss(checkpoint, config, texts[:4])  # max_batches 1: 4 docs
        assert row["eval_sequences"] == 4 and row["eval_tokens"] == count
        assert _relative(row["eval_loss"], loss) < 1e-5, (row, loss)
    assert evaluations[1]["eval_loss"] != evaluations[0]["eval_loss"], "the weights moved"
    assert _eval_rows(out) == [{k: e[k] for k in EVAL_KEYS} for e in evaluations]
    assert (out / "loss.png").stat().st_size > 0


def test_eval_over_dp_replicas_with_a_partial_last_batch(distributed, tmp_path):
    # ring 2 x dp 2: batches of 4 sequences, 2 per replica; the 6 documents leave the
    # second batch to replica 0, and replica 1 runs a padding row there
    texts = held_out_texts()
    config = eval_config(write_held_out(tmp_path / "held.jsonl", texts), every=3)
    config["parallel"] = {"ulysses": 1, "ring": 2, "dp": 2}
    config["train"].update(micro_batch=1, checkpoint_interval=3)
    results = distributed.run(
        _train_on_ranks, config, 1, 2, str(tmp_path / "dp"), world_size=4, timeout=TIMEOUT
    )
    evaluations = results[0][1]
    assert all(_values(r[1]) == _values(evaluations) for r in results)
    assert [e["step"] for e in evaluations] == [3, 4]
    single = _single(config, tmp_path / "single")
    for row, ref_row in zip(evaluations, single):
        loss, count = reference_loss(
            tmp_path / "dp" / "checkpoints" / f"step_{row['step']:06d}", config, texts
        )
        assert row["eval_sequences"] == 6 and row["eval_tokens"] == count
        assert _relative(row["eval_loss"], loss) < 1e-5, (row, loss)
        assert _relative(row["eval_loss"], ref_row["eval_loss"]) < 1e-5


def test_resume_repeats_the_evaluations_exactly(sp_eval_run, distributed, tmp_path):
    config, _, out, results = sp_eval_run
    resumed = tmp_path / "resumed"
    # "preempted" after step 3 (newest checkpoint: step 2, whose evaluation was logged)
    distributed.run(
        _train_on_ranks, config, 2, 2, str(resumed), False, 3, world_size=4, timeout=TIMEOUT
    )
    again = distributed.run(
        _train_on_ranks, config, 2, 2, str(resumed), True, world_size=4, timeout=TIMEOUT
    )
    assert [e["step"] for e in again[0][1]] == [4]
    assert again[0][0] == results[0][0][2:], "the training losses of steps 3-4 repeat"
    assert _eval_rows(resumed) == _eval_rows(out), "the same evaluations, bit for bit"


def test_eval_changes_nothing_in_training(tmp_path):
    texts = held_out_texts()
    short = {"steps": 2, "checkpoint_interval": 0}
    with_eval = eval_config(write_held_out(tmp_path / "held.jsonl", texts), every=1, **short)
    without = base_config(**short)
    runs = {}
    for name, config in (("with", with_eval), ("without", without)):
        result = train(
            train_config_from_dict(config), None, output_dir=tmp_path / name, stream=io.StringIO()
        )
        runs[name] = (result.metrics, result.evaluations, torch.get_rng_state())
    (metrics, evaluations, rng), (plain, none, plain_rng) = runs["with"], runs["without"]
    assert len(evaluations) == 2 and none == []
    keys = ("step", "loss", "grad_norm", "lr", "label_tokens")
    assert [[r[k] for k in keys] for r in metrics] == [[r[k] for k in keys] for r in plain]
    assert torch.equal(rng, plain_rng), "evaluating draws no random numbers"


def test_eval_section_is_checked(tmp_path):
    held = write_held_out(tmp_path / "held.jsonl", held_out_texts(2))
    job = train_config_from_dict(eval_config(held, every=5, max_batches=3))
    assert (job.eval.files, job.eval.every, job.eval.max_batches) == ((held,), 5, 3)
    assert job.eval.due(5, 12) and job.eval.due(12, 12) and not job.eval.due(6, 12)
    assert train_config_from_dict(base_config()).eval is None
    for body, message in [
        ({"files": [held]}, "missing required key 'every'"),
        ({"files": [], "every": 1}, "[eval] files"),
        ({"files": [held], "every": 0}, "[eval] every"),
        ({"files": [held], "every": 1, "max_batches": 0}, "[eval] max_batches"),
        ({"files": [held], "every": 1, "shuffle": True}, "[eval] unknown key 'shuffle'"),
    ]:
        config = base_config()
        config["eval"] = body
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            train_config_from_dict(config)


def test_eval_files_errors_name_the_section(tmp_path):
    config = eval_config(str(tmp_path / "missing*.jsonl"))
    with pytest.raises(ConfigError, match=r"\[eval\] files pattern .* matches no file"):
        train(train_config_from_dict(config), None, output_dir=tmp_path / "a")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}) + "\n")
    with pytest.raises(ConfigError, match="no label token"):
        train(train_config_from_dict(eval_config(str(prompts))), None, output_dir=tmp_path / "b")


def _missing_on_rank1(config, out):
    import torch.distributed as dist

    if dist.get_rank() == 1:  # as if the file were absent on one node
        config = dict(config, eval=dict(config["eval"], files=[out + "/absent.jsonl"]))
    try:
        _train_on_ranks(config, 2, 2, out)
    except ConfigError as err:
        return str(err)
    return None


def test_an_eval_file_missing_on_one_rank_fails_every_rank_alike(distributed, tmp_path):
    config = eval_config(write_held_out(tmp_path / "held.jsonl", held_out_texts(2)))
    messages = distributed.run(_missing_on_rank1, config, str(tmp_path), world_size=4, timeout=60)
    assert all(m == messages[0] for m in messages), messages
    assert "failed on rank 1 of 4" in messages[0] and "absent.jsonl" in messages[0], messages[0]


def test_progress_shows_the_eval_loss_and_the_plot_draws_it(tmp_path):
    stream = io.StringIO()
    progress = Progress(4, 0, log_interval=1, stream=stream)
    step = {
        "loss": 2.5,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s_per_gpu": 10.0,
    }
    evaluation = {
        "step": 2,
        "eval_loss": 2.25,
        "eval_perplexity": 9.49,
        "eval_tokens": 1234,
        "eval_sequences": 3,
        "eval_time_s": 0.5,
    }
    progress.update({"step": 2, **step})
    progress.evaluation(evaluation)
    progress.update({"step": 3, **step})
    lines = stream.getvalue().splitlines()
    assert "eval_loss" not in lines[0]
    assert lines[1].startswith("eval after step 2: eval_loss 2.2500") and "1,234 label" in lines[1]
    assert "eval_loss 2.2500@2" in lines[2]
    rows = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 5)]
    rows.insert(2, evaluation)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png") is None
    assert (tmp_path / "loss.png").stat().st_size > 0


def _pixels_of(png: bytes, color) -> int:
    """How many pixels of an unfiltered 8-bit RGB PNG (png_chart's) have ``color``."""
    width = struct.unpack(">I", png[16:20])[0]
    start = png.index(b"IDAT") + 4
    raw = zlib.decompress(png[start : start + struct.unpack(">I", png[start - 8 : start - 4])[0]])
    stride = 1 + 3 * width
    rows = [raw[y + 1 : y + stride] for y in range(0, len(raw), stride)]
    return sum(tuple(row[3 * x : 3 * x + 3]) == color for row in rows for x in range(width))


def test_the_builtin_chart_draws_the_eval_points(tmp_path):
    xs, ys = [1, 2, 3, 4], [3.0, 2.5, 2.2, 2.0]
    write_line_chart(tmp_path / "a.png", xs, ys)
    write_line_chart(tmp_path / "b.png", xs, ys, points=([2, 4], [2.8, 2.4]))
    assert _pixels_of((tmp_path / "a.png").read_bytes(), SECOND) == 0
    assert _pixels_of((tmp_path / "b.png").read_bytes(), SECOND) > 25, "dots, line, legend"


def test_usp_topo_checks_the_eval_files_too(tmp_path, capsys):
    from usp.cli import main

    (tmp_path / "job.toml").write_text(
        "[cluster]\nnodes = 1\ngpus_per_node = 4\n[parallel]\nulysses = 2\nring = 2\n"
        '[model]\npreset = "tiny"\n[data]\nsource = "synthetic"\n'
        "[train]\nsteps = 1\nglobal_batch = 1\nseq_len = 64\n"
        '[eval]\nfiles = ["held/*.jsonl"]\nevery = 1\n'
    )
    assert main(["topo", str(tmp_path / "job.toml")]) == 2
    assert "[eval] files pattern 'held/*.jsonl' matches no file" in capsys.readouterr().err

"""``usp train --resume`` for every model family's tiny preset, and ``usp eval`` of such a
training output.

One launch of 2 gloo ranks runs, for each preset of :data:`CASES`, two jobs in-process on
the preset's grid (:data:`GRIDS`: half the presets on Ulysses 2, half on ring 2, so a
resume is checked through both exchanges; FSDP shards every trained parameter over the 2
ranks): 4 uninterrupted steps (warm-up and cosine schedule, clipping active, a checkpoint
every 2 steps), then a resume from a copy of their step-2 checkpoint in another output
directory (what a run preempted after step 2 leaves). Checked: the resumed steps 3-4
repeat the uninterrupted ones (loss, router aux loss, gradient norm; 1e-6 relative): model
and AdamW state, the data position, the schedule, the MoE routers, the Gated DeltaNet and
Mamba-2 layers, the sliding windows and LoRA adapters (with keyed dropout) all come back,
and every family's recorded model shape reads back as its own
(``tests/train/test_train_checkpoint_shape.py`` has the comparison's cases).
``benchmarks/resume_soak.py`` runs the same check as the commands a user types (``usp
train --steps 2``, then ``--steps 4 --resume``). A resume on 4 ranks (ulysses 2 x ring 2,
the tiny preset) is tested by tests/train/test_train_faults.py; one from 4 ranks onto 1
under torchrun by test_train_launch.py.

Then, in this process: the uninterrupted run's step-2 checkpoint resumes in one process
without FSDP (another grid: DCP reshards 2 ranks' shards) for a hybrid and a hybrid MoE
family, within the float32 tolerances of one process against several ranks; and ``usp
eval`` of the Qwen3.5-MoE training output gives the same report in one process and on 4
ranks (ulysses 2 x ring 2: DCP reshards the 2 ranks' shards onto 4).
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from launch_cases import usp_in_process
from train_cases import _relative, base_config
from usp_cases import topology

from usp.cli import build_parser
from usp.evaluation.cli import evaluate_target, prepare
from usp.train.components import build_plan
from usp.train.config import train_config_from_dict
from usp.train.setup import user_errors
from usp.train.trainer import train

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]

TIMEOUT = 900
#: LoRA on the dense hybrid: rank 4, keyed dropout, the attention and MLP projections
LORA = {"rank": 4, "alpha": 8, "dropout": 0.1}
#: every family's tiny preset, and the [train] keys its case adds
CASES = {
    "tiny": {},
    "qwen3-tiny": {},
    "gpt-oss-tiny": {},  # MoE with a sliding window
    "gemma3-tiny": {},  # sliding and full layers
    "qwen3-moe-tiny": {},  # a dense first layer, then MoE
    "qwen3.5-tiny": {"lora": LORA},  # Gated DeltaNet and gated attention, LoRA adapters
    "qwen3.5-moe-tiny": {},  # Gated DeltaNet with MoE, every parameter trained
    "granite4h-tiny": {"lora": LORA},  # Mamba-2, attention without RoPE, muP; LoRA on MLPs
}
#: each preset's grid (ulysses, ring) on the 2 ranks: windows, MoE routing, Gated
#: DeltaNet's and Mamba-2's states cross ranks by the ring or by Ulysses' all-to-all
GRIDS = {
    "tiny": (1, 2),
    "qwen3-tiny": (2, 1),
    "gpt-oss-tiny": (1, 2),
    "gemma3-tiny": (2, 1),
    "qwen3-moe-tiny": (1, 2),
    "qwen3.5-tiny": (2, 1),
    "qwen3.5-moe-tiny": (1, 2),
    "granite4h-tiny": (2, 1),
}
RANKS = 2
#: the presets resumed in one process from the 2-rank checkpoint (a hybrid, a hybrid MoE)
OTHER_GRID = ("qwen3.5-tiny", "qwen3.5-moe-tiny")
EVAL_FLAGS = ["--lengths", "64,128", "--windows", "1", "--buckets", "2", "--seed", "3"]
EVAL_FLAGS += ["--dtype", "float32", "--device", "cpu"]


def resume_job(preset: str) -> dict:
    """``base_config``'s job (4 steps, warm-up and cosine schedule, clipping active, a
    checkpoint every 2 steps) on ``preset`` with its case's [train] keys, on one node of
    2 ranks with the preset's grid (:data:`GRIDS`)."""
    config = base_config(**CASES[preset])
    config["model"] = {"preset": preset}
    ulysses, ring = GRIDS[preset]
    config["cluster"] = {"nodes": 1, "gpus_per_node": RANKS}
    config["parallel"] = {"ulysses": ulysses, "ring": ring, "dp": 1}
    return config


def _rows(result) -> list[tuple]:
    """``(step, loss, aux_loss or None, grad_norm)`` of a run's steps."""
    return [(r["step"], r["loss"], r.get("aux_loss"), r["grad_norm"]) for r in result.metrics]


def _train(config: dict, out: Path, *, resume: bool = False) -> list[tuple]:
    """The job on this rank of its config's grid: its rows."""
    job = train_config_from_dict(config)
    parallel = config["parallel"]
    plan = build_plan(job, topology(parallel["ulysses"], parallel["ring"]))
    return _rows(train(job, plan, output_dir=out, resume=resume, stream=io.StringIO()))


def run_presets(root: str) -> dict[str, tuple[list, list]]:
    """Every rank: for each preset, the rows of 4 uninterrupted steps and of the resume
    from their step-2 checkpoint (copied by rank 0 into another output directory, as a run
    preempted after step 2 leaves it)."""
    results = {}
    for preset in CASES:
        where = Path(root) / preset
        full = _train(resume_job(preset), where / "full")
        if dist.get_rank() == 0:
            shutil.copytree(where / "full" / "checkpoints" / "step_000002",
                            where / "resumed" / "checkpoints" / "step_000002")  # fmt: skip
        dist.barrier()
        resumed = _train(resume_job(preset), where / "resumed", resume=True)
        results[preset] = (full, resumed)
    return results


@pytest.fixture(scope="module")
def presets_run(distributed, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_families")
    per_rank = distributed.run(run_presets, str(root), world_size=RANKS, timeout=TIMEOUT)
    return root, per_rank


def _assert_close(rows, expected, tol, what):
    assert [r[0] for r in rows] == [e[0] for e in expected], what
    for row, ref in zip(rows, expected):
        step = row[0]
        for name, a, b in zip(("loss", "aux_loss", "grad_norm"), row[1:], ref[1:]):
            assert (a is None) == (b is None), (what, step, name, a, b)
            if a is not None:
                assert _relative(a, b) <= tol, (what, step, name, a, b)


@pytest.mark.parametrize("preset", list(CASES))
def test_a_resumed_run_repeats_the_uninterrupted_steps(presets_run, preset):
    root, per_rank = presets_run
    full, resumed = per_rank[0][preset]
    assert all(r[preset] == (full, resumed) for r in per_rank), "every rank logs the same"
    assert [r[0] for r in full] == [1, 2, 3, 4]
    if preset in ("gpt-oss-tiny", "qwen3-moe-tiny", "qwen3.5-moe-tiny"):
        assert all(r[2] is not None and r[2] > 0 for r in full), "the router aux loss is logged"
    _assert_close(resumed, full[2:], 1e-6, preset)
    checkpoints = sorted(p.name for p in (root / preset / "resumed" / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000004"]


@pytest.mark.parametrize("preset", OTHER_GRID)
def test_a_2_rank_checkpoint_resumes_in_one_process(presets_run, tmp_path, preset):
    """DCP reshards the step-2 checkpoint of the uninterrupted 2-rank run onto one process
    without FSDP; float32 tolerances of one process against several ranks."""
    root, per_rank = presets_run
    full = per_rank[0][preset][0]
    source = root / preset / "full" / "checkpoints" / "step_000002"
    shutil.copytree(source, tmp_path / "checkpoints" / "step_000002")
    job = train_config_from_dict(resume_job(preset))
    result = train(job, None, output_dir=tmp_path, resume=True, stream=io.StringIO())
    rows = _rows(result)
    assert [r[0] for r in rows] == [3, 4]
    for (step, loss, aux, norm), (_, ref_loss, ref_aux, ref_norm) in zip(rows, full[2:]):
        assert _relative(loss, ref_loss) <= 1e-5, (step, loss, ref_loss)
        assert _relative(norm, ref_norm) <= 1e-4, (step, norm, ref_norm)
        assert (aux is None) == (ref_aux is None)
        assert aux is None or _relative(aux, ref_aux) <= 1e-4, (step, aux, ref_aux)


def _eval_argv(root: Path, preset: str) -> list[str]:
    """``usp eval`` of the preset's uninterrupted training output (its newest checkpoint,
    step 4) with the run's effective config.toml, its [cluster] shape taken from the
    launch (one process or 4 ranks)."""
    out = root / preset / "full"
    config = out / "config.toml"
    text = config.read_text()
    written = f"gpus_per_node = {RANKS}\n"
    assert written in text, text
    eval_config = root / preset / "eval.toml"
    eval_config.write_text(text.replace(written, 'gpus_per_node = "auto"\n'))
    return [str(out), "--config", str(eval_config), *EVAL_FLAGS, "--json"]


def evaluate_on_ranks(argv: list[str]) -> dict:
    args = build_parser().parse_args(["eval", *argv, "--ulysses", "2", "--ring", "2"])
    settings, job, _ = prepare(args)
    report, plan = evaluate_target(args, job, settings, user_errors())
    plan.topology.destroy()
    return report


def test_usp_eval_of_a_qwen3_5_moe_training_output_1_rank_equals_4(
    presets_run, distributed, tmp_path, monkeypatch
):
    root, _ = presets_run
    argv = [*_eval_argv(root, "qwen3.5-moe-tiny"), "--output", str(tmp_path / "one")]
    stdout = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert usp_in_process("eval", *argv, "--ulysses", "1", "--ring", "1") == 0
    finally:
        monkeypatch.undo()
    one = json.loads(stdout.getvalue())
    assert "step_000004" in one["target"] and one["ranks"] == 1
    argv[argv.index("--output") + 1] = str(tmp_path / "four")
    reports = distributed.run(evaluate_on_ranks, argv, world_size=4, timeout=TIMEOUT)
    assert all(r["perplexity"] == reports[0]["perplexity"] for r in reports)
    four = reports[0]
    assert four["ranks"] == 4 and "ring 0/2, ulysses 0/2" in four["plan"], four["plan"]
    assert one["lengths"] == four["lengths"] == [64, 128]
    for length, ours in four["perplexity"].items():
        theirs = one["perplexity"][length]
        assert ours["tokens"] == theirs["tokens"] and ours["windows"] == theirs["windows"] == 1
        for a, b in zip(ours["values"] + [ours["overall"]], theirs["values"] + [theirs["overall"]]):
            assert b > 1 and _relative(a, b) <= 1e-5, (length, a, b)
